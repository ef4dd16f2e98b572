"""The exceptions of ddp_avg_hooks.

Example:
    >>> from ddp_avg_hooks.errors import AveragingHookError
    >>> issubclass(AveragingHookError, RuntimeError)
    True
"""

from __future__ import annotations

__all__ = ["AveragingHookError", "CheckpointError", "SettingsMismatchError"]


class AveragingHookError(RuntimeError):
    """An averaging hook failed or returned something other than the contract says.

    The message names the hook, the bucket, the round and what was expected. Nothing of
    the failed round is written; the step that ran it still counts
    (``AveragingHandle.step_count``), so the following rounds keep their steps.
    """


class SettingsMismatchError(ValueError):
    """Ranks that must share a setting registered it differently (or a checkpoint was
    made with another one). Raised on every rank; the message names the setting, the
    values and the ranks."""


class CheckpointError(RuntimeError):
    """A checkpoint folder cannot be resumed: every round in it is damaged, it was made
    with another world size or model, or it belongs to another run. Nothing was loaded."""
