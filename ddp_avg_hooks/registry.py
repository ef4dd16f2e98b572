"""``register_averaging_hook``: checks the arguments, builds the buckets, makes the ranks agree."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._groups import group_of_state, is_member, or_world
from .bucket import assign_buckets
from .models import averaged_model
from .errors import AveragingHookError
from .handle import AveragingHandle, AveragingStats, difference
from .observers import make_observers
from .options import AveragingOptions
from .planner import split_fragments
from .policies import make_policies
from .protocol import hook_spec
from .rounds import RoundEngine
from .schedules import PeriodSchedule
from .storage import DeviceStorage, HostStorage, ZeroCopyStorage

__all__ = ["AveragingHandle", "AveragingHookError", "AveragingStats", "register_averaging_hook"]


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
            first = differ[0]
            what = difference(key, values[first], values[0],
                              theirs_at=f"on rank {first}", mine_at="on rank 0")
            raise ValueError(
                f"register_averaging_hook: ranks disagree on {key!r} (ranks {differ} differ "
                f"from rank 0): {what}. "
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
            (and not those DDP ignores) are averaged, or ``torch.compile`` of one; or an
            FSDP2 module (the root ``fully_shard`` returned, on a 1-D mesh per replica
            group), whose local shards are averaged over the hook state's group, the
            replicate group (see :mod:`ddp_avg_hooks.models`).
        hook: ``hook(state, bucket) -> Future[Tensor]``, e.g. ``hooks.allreduce_hook``.
        state: passed to every hook call (``None`` or a process group for the built-ins).
        period: average every ``period`` steps after the warm-up (``>= 1``), or a
            schedule from ``ddp_avg_hooks.schedules``.
        warmup_steps: steps before the first round, during which DDP still averages
            gradients (``>= 0``).
        bucket_cap_mb: largest bucket, in MiB (``> 0``); bigger parameters get their own.
        optimizer: if given, :meth:`AveragingHandle.step` runs after each of its steps.
        **options: the other settings (``overlap``, ``fragments``, ``check_finite``,
            ``offload_state``, ...), each documented and checked by
            :class:`~ddp_avg_hooks.options.AveragingOptions` (``AveragingOptions.doc(name)``).

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
    model = averaged_model(ddp_model)
    if not callable(hook):
        raise TypeError("register_averaging_hook: hook must be callable, got "
                        f"{type(hook).__name__}")
    opts = AveragingOptions.from_call(period=period, warmup_steps=warmup_steps,
                                      bucket_cap_mb=bucket_cap_mb, optimizer=optimizer, **options)
    spec = hook_spec(hook)
    spec.validate(state)

    params = model.params
    if opts.zero_copy:
        storage = functools.partial(ZeroCopyStorage, in_place=not opts.check_finite)
    else:
        storage = HostStorage if opts.offload_state else DeviceStorage
    keep_anchor = opts.wants_anchor(spec.needs_anchor)
    fragments, buckets = [], []
    parts = split_fragments(params, opts.fragments, allow_empty=model.sharded)
    for i, part in enumerate(parts):
        fragments.append(assign_buckets(part, bucket_cap_mb, first_index=len(buckets),
                                        ends=i == len(parts) - 1, keep_anchor=keep_anchor,
                                        storage=storage))
        buckets += fragments[-1]
    group = or_world(opts.process_group if opts.process_group is not None
                     else group_of_state(state))
    key_of = {id(t): k for t, k in zip(model.params, model.keys)}
    in_bucket_order = [key_of[id(p)] for b in buckets for p in b.parameters()]
    engine = RoundEngine(hook, state, buckets, exact_group=group, check_finite=opts.check_finite,
                         fragments=fragments, mixing=opts.mixing, linear=spec.linear,
                         weighted=opts.weighted,
                         policies=make_policies(opts, model, in_bucket_order),
                         observers=make_observers(opts))
    handle = AveragingHandle(engine, opts, model=model)
    _agree_across_ranks(handle, group)
    for bucket in buckets:
        spec.prepare(state, bucket)
    if optimizer is not None:
        handle.attach_optimizer(optimizer)
    return handle
