"""ddp_avg_hooks: local SGD for PyTorch DDP through averaging hooks.

Example:
    >>> import ddp_avg_hooks as dah
    >>> callable(dah.register_averaging_hook), callable(dah.hooks.allreduce_hook)
    (True, True)
"""

from . import (checkpoint, collectives, errors, grad_hooks, hierarchy, hooks, memory, models, ops,
               rounds, schedules, storage)
from .bucket import ParamBucket
from .errors import AveragingHookError
from .handle import AveragingHandle
from .optim import AveragingOptimizer
from .options import AveragingOptions
from .protocol import HookSpec, averaging_hook, hook_spec, needs_anchor
from .registry import register_averaging_hook
from .rounds import AveragingStats

__all__ = [
    "AveragingHandle",
    "AveragingHookError",
    "AveragingOptimizer",
    "AveragingOptions",
    "AveragingStats",
    "HookSpec",
    "ParamBucket",
    "averaging_hook",
    "checkpoint",
    "collectives",
    "errors",
    "grad_hooks",
    "hierarchy",
    "hook_spec",
    "hooks",
    "memory",
    "models",
    "needs_anchor",
    "ops",
    "register_averaging_hook",
    "rounds",
    "schedules",
    "storage",
]
__version__ = "0.1.0"
