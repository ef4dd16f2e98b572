"""Built-in averaging hooks: ``hook(state, bucket) -> Future[Tensor]``."""

from .default import allreduce_hook

__all__ = ["allreduce_hook"]
