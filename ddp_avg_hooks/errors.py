"""The exceptions of ddp_avg_hooks.

Example:
    >>> from ddp_avg_hooks.errors import AveragingHookError
    >>> issubclass(AveragingHookError, RuntimeError)
    True
"""

from __future__ import annotations

__all__ = ["AveragingHookError"]


class AveragingHookError(RuntimeError):
    """An averaging hook failed or returned something other than the contract says.

    The message names the hook, the bucket, the round and what was expected.
    """
