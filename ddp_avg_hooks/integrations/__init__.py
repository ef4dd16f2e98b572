"""Thin layers over :func:`~ddp_avg_hooks.register_averaging_hook` for training frameworks.

Each submodule imports its framework, so import the one you use:

- :mod:`ddp_avg_hooks.integrations.lightning`: ``AveragingCallback``, a Lightning
  ``Callback`` for ``Trainer(strategy="ddp")``.
- :mod:`ddp_avg_hooks.integrations.accelerate`: ``LocalSGD``, the context manager of
  ``accelerate.local_sgd.LocalSGD`` with this library's hooks.
- :mod:`ddp_avg_hooks.integrations.transformers`: ``add_local_sgd(trainer, ...)``, a
  ``TrainerCallback`` for the Hugging Face ``Trainer``.
- :mod:`ddp_avg_hooks.integrations.torchft`: ``allreduce_hook``, ``TorchftState`` and
  ``FaultTolerantAveraging``: rounds across torchft replica groups that fail and rejoin.

Importing this package imports none of the frameworks.
"""
