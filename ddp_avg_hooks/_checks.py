"""Argument checks shared by every public entry point, with messages that name the fix.

Example:
    >>> from ddp_avg_hooks._checks import check_int
    >>> check_int("period", 4, minimum=1)
    4
    >>> check_int("period", True, minimum=1)
    Traceback (most recent call last):
    ...
    TypeError: period must be an int, got bool
"""

from __future__ import annotations


def _prefix(owner: str) -> str:
    return f"{owner}: " if owner else ""


def check_int(name: str, value, minimum: int, *, owner: str = "", fix: str = "") -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_prefix(owner)}{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(
            f"{_prefix(owner)}{name} must be >= {minimum}, got {value}"
            + (f"; {fix}" if fix else "")
        )
    return value


def check_bool(name: str, value, *, owner: str = "") -> bool:
    """``value`` if it is ``True`` or ``False``; else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{_prefix(owner)}{name} must be True or False, got {value!r}")
    return value
