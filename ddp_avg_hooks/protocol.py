"""The hook protocol: what a hook may declare beside ``hook(state, bucket) -> Future``.

A plain function is a complete averaging hook. A hook that needs more declares it once,
with :func:`averaging_hook`, which attaches one :class:`HookSpec` as the function's
``averaging_spec`` attribute. The registry reads it with :func:`hook_spec` (which also
looks through ``functools.partial``), and ``functools.wraps`` carries it to a wrapper,
so a wrapper forwards nothing by hand.

Example:
    >>> import ddp_avg_hooks as dah
    >>> def check(state):
    ...     if state is not None:
    ...         raise TypeError("my_hook: state must be None")
    >>> @dah.averaging_hook(needs_anchor=True, validate_state=check)
    ... def my_hook(state, bucket):
    ...     ...
    >>> dah.hook_spec(my_hook).needs_anchor, dah.hook_spec(print).needs_anchor
    (True, False)
    >>> dah.hook_spec(my_hook).validate(1)
    Traceback (most recent call last):
    ...
    TypeError: my_hook: state must be None
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

SPEC_ATTRIBUTE = "averaging_spec"


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """What an averaging hook declares about itself.

    Attributes:
        needs_anchor: the hook reads ``bucket.anchor()`` or ``bucket.delta()``, so its
            buckets keep the parameters as of the last round (one copy of them).
        validate_state: ``validate_state(state)`` raises ``TypeError``/``ValueError`` for
            a state the hook cannot use; called once, at registration.
        prepare_bucket: ``prepare_bucket(state, bucket)`` creates per-bucket memory at
            registration (so a fresh handle's ``state_dict()`` already has the structure
            a checkpoint loads into).
        linear: the result's change from the anchor is linear in the ranks' changes
            (an average, compressed or not): if every rank's change is multiplied by
            ``c``, so is the result's. Weighted time-based rounds then start without
            waiting for the other ranks' step counts, and correct the result's scale
            when they arrive (see ``schedules.EverySeconds``).
        settings: ``settings(state) -> dict`` of plain values: the state's settings that
            every rank must share (a block size, a rank, an outer learning rate). The
            registry compares them across the averaging group and a checkpoint's against
            the handle's, naming the setting that differs.
    """

    needs_anchor: bool = False
    validate_state: Callable[[object], None] | None = None
    prepare_bucket: Callable[[object, object], None] | None = None
    linear: bool = False
    settings: Callable[[object], dict] | None = None

    def validate(self, state) -> None:
        """Run ``validate_state`` (if any) on ``state``."""
        if self.validate_state is not None:
            self.validate_state(state)

    def prepare(self, state, bucket) -> None:
        """Run ``prepare_bucket`` (if any) on ``bucket``."""
        if self.prepare_bucket is not None:
            self.prepare_bucket(state, bucket)

    def settings_of(self, state) -> dict:
        """The settings ``state`` declares (``{}`` without a ``settings`` declaration)."""
        return {} if self.settings is None else dict(self.settings(state))


def averaging_hook(
    fn: Callable | None = None,
    *,
    needs_anchor: bool = False,
    validate_state: Callable | None = None,
    prepare_bucket: Callable | None = None,
    linear: bool = False,
    settings: Callable | None = None,
):
    """Attach a :class:`HookSpec` to a hook function (as ``fn.averaging_spec``); returns ``fn``.

    Usable bare (``@averaging_hook``, which declares nothing) or with arguments.
    Declarations add up: what ``fn`` already declares (by :func:`needs_anchor`, an
    earlier ``averaging_hook``, or ``functools.wraps`` of a declared hook) is kept,
    except the functions this call names, which replace the earlier ones.

    Example:
        >>> import functools
        >>> import ddp_avg_hooks as dah
        >>> @dah.averaging_hook(settings=lambda state: {"scale": state["scale"]})
        ... def scaled_hook(state, bucket): ...
        >>> dah.hook_spec(scaled_hook).settings_of({"scale": 0.5})
        {'scale': 0.5}
        >>> @dah.averaging_hook(settings=lambda state: {"tag": "mine"})
        ... @functools.wraps(dah.hooks.int8_compress_hook)
        ... def my_int8(state, bucket):
        ...     return dah.hooks.int8_compress_hook(state, bucket)
        >>> spec = dah.hook_spec(my_int8)
        >>> spec.needs_anchor, spec.validate_state is not None, spec.settings_of(None)
        (True, True, {'tag': 'mine'})
    """

    def attach(hook: Callable) -> Callable:
        old = hook_spec(hook)
        spec = HookSpec(
            needs_anchor=bool(needs_anchor) or old.needs_anchor,
            validate_state=old.validate_state if validate_state is None else validate_state,
            prepare_bucket=old.prepare_bucket if prepare_bucket is None else prepare_bucket,
            linear=bool(linear) or old.linear,
            settings=old.settings if settings is None else settings)
        setattr(hook, SPEC_ATTRIBUTE, spec)
        return hook

    return attach if fn is None else attach(fn)


def needs_anchor(hook: Callable) -> Callable:
    """Declare that ``hook`` reads ``bucket.anchor()`` or ``bucket.delta()``.

    Shorthand for ``averaging_hook(needs_anchor=True)``, keeping any other declaration.

    Example:
        >>> import ddp_avg_hooks as dah
        >>> @dah.needs_anchor
        ... def my_delta_hook(state, bucket): ...
        >>> dah.hook_spec(my_delta_hook).needs_anchor
        True
    """
    setattr(hook, SPEC_ATTRIBUTE, dataclasses.replace(hook_spec(hook), needs_anchor=True))
    return hook


def _unwrap_partial(hook):
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def hook_spec(hook: Callable) -> HookSpec:
    """The :class:`HookSpec` ``hook`` declares (through ``functools.partial``), else an
    empty one."""
    spec = getattr(hook, SPEC_ATTRIBUTE, None)
    if spec is None:
        spec = getattr(_unwrap_partial(hook), SPEC_ATTRIBUTE, None)
    if spec is not None and not isinstance(spec, HookSpec):
        raise TypeError(
            f"{hook_name(hook)}.{SPEC_ATTRIBUTE} must be a ddp_avg_hooks.HookSpec, got "
            f"{type(spec).__name__}; declare it with @ddp_avg_hooks.averaging_hook(...)"
        )
    return spec or HookSpec()


def hook_name(hook: Callable) -> str:
    """``module.qualname`` of a hook (of the function inside a ``functools.partial``).

    Example:
        >>> import functools, ddp_avg_hooks as dah
        >>> hook_name(functools.partial(dah.hooks.allreduce_hook))
        'ddp_avg_hooks.hooks.default.allreduce_hook'
    """
    inner = _unwrap_partial(hook)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    module = getattr(inner, "__module__", None)
    return f"{module}.{name}" if module else name
