"""``register_averaging_hook``: checks the arguments, builds the buckets, makes the ranks agree."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .bucket import assign_buckets, hook_attribute
from .handle import (
    OPTIMIZER_STATE_POLICIES,
    AveragingHandle,
    AveragingHookError,
    AveragingStats,
    HandleOptions,
    difference,
    warn_redundant_buffer_averaging,
)
from .hooks._comm import is_group, is_member
from .schedules import PeriodSchedule, as_schedule

__all__ = ["AveragingHandle", "AveragingHookError", "AveragingStats", "register_averaging_hook"]

_OPTIONS = ("keep_anchor", "process_group") + tuple(HandleOptions.__dataclass_fields__)


def _hook_name(hook) -> str:
    inner = hook
    while getattr(inner, "func", None) is not None and not hasattr(inner, "__qualname__"):
        inner = inner.func
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    module = getattr(inner, "__module__", None)
    return f"{module}.{name}" if module else name


def _resolve_process_group(state, explicit):
    """The group whose ranks must agree: explicit, else the hook state's, else WORLD."""
    if explicit is not None:
        if not is_group(explicit):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup, got {type(explicit).__name__}"
            )
        return explicit
    if is_group(state):
        return state
    group = getattr(state, "process_group", None)
    return group if is_group(group) else dist.group.WORLD


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _options(options: dict, optimizer) -> tuple[HandleOptions, bool | None, object]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"register_averaging_hook: unknown option(s) {unknown}; accepted: {list(_OPTIONS)}"
        )
    keep_anchor = options.pop("keep_anchor", None)
    group = options.pop("process_group", None)
    for flag in ("check_finite", "verify", "overlap", "track_consensus", "average_buffers"):
        if not isinstance(options.get(flag, False), bool):
            raise TypeError(f"{flag} must be True or False, got {options[flag]!r}")
    policy = options.get("optimizer_state", "keep")
    if policy not in OPTIMIZER_STATE_POLICIES:
        raise ValueError(
            f"optimizer_state must be one of {OPTIMIZER_STATE_POLICIES}, got {policy!r}"
        )
    if policy != "keep" and optimizer is None:
        raise ValueError(
            f"optimizer_state={policy!r} needs the optimizer: pass optimizer=... as well"
        )
    on_round = options.get("on_round")
    if on_round is not None and not callable(on_round):
        raise TypeError(f"on_round must be callable(handle), got {type(on_round).__name__}")
    return HandleOptions(**options), keep_anchor, group


def _agree_across_ranks(handle: AveragingHandle, group) -> None:
    """Every rank of ``group`` checks that all registered the same thing."""
    if not is_member(group) or dist.get_world_size(group) == 1:
        return
    mine = handle.config()
    gathered: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except Exception as exc:
        raise RuntimeError(
            "register_averaging_hook: could not exchange settings with the other ranks "
            f"(did every rank of the group register the hook?): {exc}"
        ) from exc
    for key in mine:
        values = [g[key] for g in gathered]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise ValueError(
                f"register_averaging_hook: ranks disagree on {key!r} (ranks {differ} differ "
                f"from rank 0): {difference(key, values[differ[0]], values[0]).replace('there', f'on rank {differ[0]}').replace('here', 'on rank 0')}. "
                "Every rank must register the same hook, period, warmup_steps and model"
            )


def register_averaging_hook(
    ddp_model: DistributedDataParallel,
    hook: Callable,
    state,
    *,
    period: int | PeriodSchedule = 1,
    warmup_steps: int = 0,
    bucket_cap_mb: float = 25.0,
    optimizer: torch.optim.Optimizer | None = None,
    **options,
) -> AveragingHandle:
    """Average ``ddp_model``'s parameters every ``period`` steps with ``hook``.

    ``hook(state, bucket)`` is called per :class:`ParamBucket` and returns a
    ``torch.futures.Future`` of the bucket's new flat parameters, which are copied into
    the parameters in place. Collective: every rank of the averaging group calls it,
    with the same hook, period, warm-up and model, or every rank raises.

    Args:
        ddp_model: the ``DistributedDataParallel`` model whose trainable parameters
            (and not those DDP ignores) are averaged.
        hook: ``hook(state, bucket) -> Future[Tensor]``, e.g. ``hooks.allreduce_hook``.
        state: passed to every hook call (``None`` or a process group for the built-ins).
        period: average every ``period`` steps after the warm-up (``>= 1``), or a
            schedule from ``ddp_avg_hooks.schedules``.
        warmup_steps: steps before the first round, during which DDP still averages
            gradients (``>= 0``).
        bucket_cap_mb: largest bucket, in MiB (``> 0``); bigger parameters get their own.
        optimizer: if given, :meth:`AveragingHandle.step` runs after each of its steps.
        **options:
            ``keep_anchor`` (bool; default: the hook's ``needs_anchor`` mark);
            ``check_finite`` (reject a round with nan/inf before writing anything);
            ``verify`` (compare the counter and a checksum of the result across ranks
            after each round); ``process_group`` (the group whose ranks must agree;
            default: the state's group, else the default group); ``overlap`` (launch
            rounds asynchronously, see :class:`AveragingHandle`); ``average_buffers``
            (average floating-point buffers exactly at each round); ``optimizer_state``
            (``"keep"``, ``"average"`` or ``"reset"`` the optimizer's momentum/moments
            at each round; needs ``optimizer=``); ``track_consensus`` (measure
            ``stats.consensus_distance`` at each round, one scalar allreduce);
            ``on_round`` (``callable(handle)`` run on every rank after each round).

    Returns:
        An :class:`AveragingHandle`.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
        ...                                      period=4, warmup_steps=2, optimizer=opt)
        >>> for _ in range(7):
        ...     opt.zero_grad(); ddp(torch.randn(3, 4)).sum().backward(); opt.step()
        >>> handle.step_count, handle.stats.rounds
        (7, 2)
        >>> handle.remove(); dist.destroy_process_group()
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            "register_averaging_hook: ddp_model must be a "
            f"torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}; "
            "wrap the model with DistributedDataParallel(model) first"
        )
    if not callable(hook):
        raise TypeError(f"register_averaging_hook: hook must be callable, got {type(hook).__name__}")
    if not isinstance(period, PeriodSchedule):
        _check_int("period", period, 1)
    _check_int("warmup_steps", warmup_steps, 0)
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number, got {type(bucket_cap_mb).__name__}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    handle_options, keep_anchor, explicit_group = _options(dict(options), optimizer)
    validate = hook_attribute(hook, "validate_state")
    if validate is not None:
        validate(state)

    ignored = getattr(ddp_model, "parameters_to_ignore", set()) or set()
    params = [
        p
        for name, p in ddp_model.module.named_parameters()
        if p.requires_grad and name not in ignored
    ]
    if not params:
        raise ValueError(
            "register_averaging_hook: the model has no trainable parameters to average "
            "(all have requires_grad=False or are ignored by DDP)"
        )
    buffers = []
    if handle_options.average_buffers:
        warn_redundant_buffer_averaging(ddp_model)
        buffers = [b for name, b in ddp_model.module.named_buffers()
                   if b.is_floating_point() and name not in ignored]
    if keep_anchor is None:
        keep_anchor = bool(hook_attribute(hook, "needs_anchor", False)) or handle_options.overlap
    group = _resolve_process_group(state, explicit_group)
    handle = AveragingHandle(
        ddp_model,
        hook,
        _hook_name(hook),
        state,
        assign_buckets(params, bucket_cap_mb, keep_anchor=bool(keep_anchor)),
        schedule=as_schedule(period),
        warmup_steps=warmup_steps,
        process_group=group,
        options=handle_options,
        buffers=buffers,
        bucket_cap_mb=bucket_cap_mb,
    )
    _agree_across_ranks(handle, group)
    prepare = hook_attribute(hook, "prepare_bucket")
    if prepare is not None:
        for bucket in handle.buckets:
            prepare(state, bucket)
    if optimizer is not None:
        handle.attach_optimizer(optimizer)
    return handle
