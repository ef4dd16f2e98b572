"""Runnable examples: ``python -m ddp_avg_hooks.examples.train`` (torchrun program), ``.demo``, ``.netns``."""
