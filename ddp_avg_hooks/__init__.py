"""ddp_avg_hooks: local SGD for PyTorch DDP through averaging hooks.

Example:
    >>> import ddp_avg_hooks as dah
    >>> callable(dah.register_averaging_hook), callable(dah.hooks.allreduce_hook)
    (True, True)
"""

from . import grad_hooks, hierarchy, hooks, ops, schedules
from .bucket import ParamBucket, needs_anchor
from .optim import AveragingOptimizer
from .registry import (
    AveragingHandle,
    AveragingHookError,
    AveragingStats,
    register_averaging_hook,
)

__all__ = [
    "AveragingHandle",
    "AveragingHookError",
    "AveragingOptimizer",
    "AveragingStats",
    "ParamBucket",
    "grad_hooks",
    "hierarchy",
    "hooks",
    "needs_anchor",
    "ops",
    "register_averaging_hook",
    "schedules",
]
__version__ = "0.1.0"
