"""``register_averaging_hook``: checks the arguments, builds the buckets, makes the ranks agree."""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._groups import group_of_state, is_member, or_world
from .bucket import assign_buckets
from .collectives import backend_device
from .models import averaged_model
from .errors import AveragingHookError
from .errors import SettingsMismatchError
from .handle import AveragingHandle, AveragingStats, align_anchors, difference, setting_name
from .observers import make_observers
from .options import AveragingOptions
from .planner import split_fragments
from .policies import make_policies
from .protocol import hook_spec
from .rounds import RoundEngine
from .schedules import PeriodSchedule
from .storage import DeviceStorage, HostStorage, ZeroCopyStorage

__all__ = ["AveragingHandle", "AveragingHookError", "AveragingStats", "register_averaging_hook"]


def warn_on_shared_elastic_store() -> bool:
    """Warn (once, as Python shows warnings) when torchrun may restart these workers
    (``--max-restarts`` > 0) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is not ``1``:
    restarted gloo workers can then read a peer address the previous attempt left in
    torchrun's shared store and fail with ``connectFullMesh ... Connection refused``.
    Returns whether it warned."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not restarts.isdigit() or int(restarts) == 0:
        return False
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return False
    warnings.warn(
        f"torchrun may restart this job (--max-restarts {restarts}) and "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not set: restarted gloo workers can fail to "
        "reconnect ('connectFullMesh ... Connection refused', pytorch/pytorch#135712) and use "
        "up the restarts. Run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
        "environment, with --standalone or --rdzv-backend c10d alike",
        stacklevel=3)
    return True


_STATE_HOLDERS: dict[int, weakref.ref] = {}


def _states_with_memory(state, spec) -> list:
    """``state`` and the state it wraps (``OuterOptimizerState.inner_state``), when the
    hook keeps memory per bucket in them; ``None`` and process groups keep none."""
    out = []
    while spec.prepare_bucket is not None and state is not None \
            and not isinstance(state, dist.ProcessGroup):
        out.append(state)
        state = getattr(state, "inner_state", None)
    return out


def _check_state_free(state, spec) -> None:
    """Refuse a hook state with memory per bucket (error-feedback residuals, PowerSGD's
    factors, an outer optimizer's momentum) that a live registration already uses: two
    models sharing it would mix that memory, and buckets of equal sizes would not even
    fail. ``None`` and a process group may be shared."""
    for held in _states_with_memory(state, spec):
        ref = _STATE_HOLDERS.get(id(held))
        holder = ref() if ref is not None else None
        if holder is not None and not holder.removed:  # it keeps ``held`` alive: same object
            raise ValueError(
                f"register_averaging_hook: this {type(held).__name__} already serves a live "
                f"registration ({holder!r}); its memory per bucket (residuals, factors, "
                "momentum) belongs to that model. Give each registration a state of its own, "
                "or call remove() on the other handle first (a state kept across remove() "
                "and registering again resumes its memory)")


def _hold_state(state, spec, handle: AveragingHandle) -> None:
    """Record that ``handle`` uses ``state`` (see :func:`_check_state_free`)."""
    for key, ref in list(_STATE_HOLDERS.items()):  # forget handles gone or removed
        holder = ref()
        if holder is None or holder.removed:
            del _STATE_HOLDERS[key]
    for held in _states_with_memory(state, spec):
        _STATE_HOLDERS[id(held)] = weakref.ref(handle)


def _agree_across_ranks(handle: AveragingHandle, group) -> None:
    """Every rank of ``group`` checks that all registered the same settings; a difference
    raises :class:`~ddp_avg_hooks.errors.SettingsMismatchError` on every rank, naming the
    setting, the values and the ranks."""
    if not is_member(group):
        return
    mine = handle.config()  # a single rank too: a hook's settings(state) runs here
    if dist.get_world_size(group) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except Exception as exc:
        raise RuntimeError(
            "register_averaging_hook: could not exchange settings with the other ranks of "
            f"the averaging group (ranks {dist.get_process_group_ranks(group)}) within its "
            "timeout: did every rank of the group register the hook, with the same group? (a "
            "hook state or process_group= naming another group on some rank is a likely "
            f"cause): {exc}"
        ) from exc
    ranks = dist.get_process_group_ranks(group)
    mismatch = None
    for key in mine:
        values = [g.get(key) for g in gathered]
        differ = [ranks[i] for i, v in enumerate(values) if v != values[0]]
        if differ:
            first = ranks.index(differ[0])
            name = setting_name(key, values[first], values[0])
            what = difference(key, values[first], values[0],
                              theirs_at=f"on rank {differ[0]}", mine_at=f"on rank {ranks[0]}")
            mismatch = (
                f"register_averaging_hook: ranks disagree on {name!r} (ranks {differ} differ "
                f"from rank {ranks[0]}): {what}. Every rank of the averaging group must "
                "register the same hook with the same settings (the options in "
                "AveragingOptions.AGREED and the hook state's) and the same model"
            )
            break
    if handle.sharded and dist.get_world_size(handle.replica_group) > 1:
        # FSDP2: the other replicate groups' ranks train with this one's shards; they
        # stop too, rather than fail later in FSDP2's collectives
        flag = torch.tensor([0 if mismatch is None else 1], dtype=torch.int32,
                            device=backend_device(handle.replica_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=handle.replica_group)
        if mismatch is None and flag.item():
            mismatch = (
                "register_averaging_hook: the ranks of another replicate group (holding the "
                "other shards of this replica) registered different settings; their error "
                "names the setting. Every rank must register the same hook with the same "
                "settings and the same model")
    if mismatch is not None:
        raise SettingsMismatchError(mismatch)


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

    ``hook(state, bucket)`` is called per :class:`~ddp_avg_hooks.ParamBucket` and returns a
    ``torch.futures.Future`` of the bucket's new flat parameters, which are copied into
    the parameters in place. Collective: every rank of the averaging group calls it,
    with the same hook, period, warm-up and model, or every rank raises.

    Args:
        ddp_model: the ``DistributedDataParallel`` model whose trainable parameters
            (and not those DDP ignores) are averaged, or ``torch.compile`` of one; or an
            FSDP2 module (the root ``fully_shard`` returned, on a 1-D mesh per replica
            group), whose local shards are averaged over the hook state's group, the
            replicate group (see :mod:`ddp_avg_hooks.models`). The parameters are those
            trainable at registration, as DDP fixes its own when it is built: one
            unfrozen later is averaged only after ``remove()`` and a new registration.
            So are their dtype and device: a round after the model is cast or moved
            (``model.to(torch.float64)``) raises ``RuntimeError``, changing nothing.
        hook: ``hook(state, bucket) -> Future[Tensor]``, e.g. ``hooks.allreduce_hook``.
        state: passed to every hook call (``None`` or a process group for the built-ins).
            A state with memory per bucket (``QuantizedDeltaState``, ``PowerSGDState``,
            ...) serves one live registration at a time: another is refused until the
            first handle's ``remove()``.
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
    warn_on_shared_elastic_store()
    if not callable(hook):
        raise TypeError("register_averaging_hook: hook must be callable, got "
                        f"{type(hook).__name__}")
    opts = AveragingOptions.from_call(period=period, warmup_steps=warmup_steps,
                                      bucket_cap_mb=bucket_cap_mb, optimizer=optimizer, **options)
    if optimizer is not None:
        model.check_optimizer(optimizer, "register_averaging_hook: optimizer=")
    spec = hook_spec(hook)
    spec.validate(state)
    _check_state_free(state, spec)

    params = model.params
    if opts.zero_copy:
        storage = functools.partial(ZeroCopyStorage, in_place=not opts.check_finite)
    else:
        storage = HostStorage if opts.offload_state else DeviceStorage
    keep_anchor = opts.wants_anchor(spec.needs_anchor)
    fragments, buckets = [], []
    parts = split_fragments(params, opts.fragments, allow_empty=model.sharded,
                            layout=opts.fragment_layout)
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
    try:
        _agree_across_ranks(handle, group)
        if opts.warmup_steps == 0 and align_anchors(buckets, group):
            warnings.warn(
                "register_averaging_hook: the replicas' parameters differ at registration, "
                "so the changes start from their average and the first round brings them "
                "together. Start every replica from the same model: DistributedDataParallel "
                "broadcasts rank 0's at construction; FSDP2 replica groups must initialize "
                "alike (the same seed before building the model, or load the same weights)",
                stacklevel=2)
        for bucket in buckets:
            spec.prepare(state, bucket)
        _hold_state(state, spec, handle)
        if optimizer is not None:
            handle.attach_optimizer(optimizer)
    except BaseException:
        handle.remove()  # a registration that failed leaves nothing live behind
        raise
    return handle
