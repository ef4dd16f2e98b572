"""``no_grad``: ``torch.no_grad()`` as a decorator, at no cost when grad is already off.

``@torch.no_grad()`` makes and enters a context manager at every call, which the hot
paths of a round (one call per bucket, several per round) pay again and again even
when their caller already turned grad off. This one checks first.

Example:
    >>> import torch
    >>> from ddp_avg_hooks._grad import no_grad
    >>> @no_grad
    ... def grad_on() -> bool:
    ...     return torch.is_grad_enabled()
    >>> grad_on(), torch.is_grad_enabled()
    (False, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def no_grad(fn: F) -> F:
    """``fn`` run with grad off: as ``@torch.no_grad()``, without a context manager when
    grad is off already."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
