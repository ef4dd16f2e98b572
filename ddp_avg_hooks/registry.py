"""``register_averaging_hook`` and ``AveragingHandle``: the schedule, the checks, the rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .bucket import ParamBucket, assign_buckets, hook_attribute
from .hooks._comm import is_group, is_member

_OPTIONS = ("keep_anchor", "check_finite", "verify", "process_group")


class AveragingHookError(RuntimeError):
    """An averaging hook failed or returned something other than the contract says."""


@dataclass
class AveragingStats:
    """What averaging has cost so far on this rank.

    Attributes:
        rounds: averaging rounds completed.
        bytes_sent: bytes of the tensors this rank handed to collectives for averaging
            (as recorded by hooks with ``bucket.record_sent``).
        seconds: wall-clock seconds spent in rounds (copies, hooks and write-back).
    """

    rounds: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


def _hook_name(hook) -> str:
    inner = hook
    while getattr(inner, "func", None) is not None and not hasattr(inner, "__qualname__"):
        inner = inner.func
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    module = getattr(inner, "__module__", None)
    return f"{module}.{name}" if module else name


def _resolve_process_group(state, explicit) -> dist.ProcessGroup:
    """The group whose ranks must agree: explicit, else the hook state's, else WORLD."""
    if explicit is not None:
        return explicit
    if is_group(state):
        return state
    group = getattr(state, "process_group", None)
    return group if is_group(group) else dist.group.WORLD


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Order-independent exact checksum of ``t``'s bits (the same on any thread count)."""
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(int_type).sum(dtype=torch.int64)


class AveragingHandle:
    """What :func:`register_averaging_hook` returns: the schedule and the rounds.

    Call :meth:`step` after every optimizer step (or register with ``optimizer=``).
    Averaging happens at step ``s`` (the number of earlier ``step()`` calls) iff
    ``s >= warmup_steps and (s - warmup_steps) % period == 0``, exactly as PyTorch's
    ``PeriodicModelAverager``.

    With a ``GradScaler``, do not pass ``optimizer=``: the scaler skips
    ``optimizer.step()`` on a rank whose gradients overflowed, and after the warm-up
    gradients are local, so it may skip on one rank only. Call ``handle.step()`` every
    iteration instead, after ``scaler.step(opt); scaler.update()``, so every rank's
    counter advances together (``verify=True`` catches counters that drift apart).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
        ...                                      period=3, warmup_steps=1)
        >>> [handle.step() for _ in range(6)], handle.in_warmup
        ([False, True, False, False, True, False], False)
        >>> handle.stats.rounds, handle.stats.bytes_sent
        (2, 80)
        >>> handle.load_state_dict(handle.state_dict()); handle.step_count
        6
        >>> handle.remove(); dist.destroy_process_group()
    """

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        hook: Callable,
        state,
        buckets: list[ParamBucket],
        *,
        period: int,
        warmup_steps: int,
        process_group: dist.ProcessGroup,
        check_finite: bool,
        verify: bool,
    ) -> None:
        self._ddp = ddp_model
        self._hook = hook
        self._hook_name = _hook_name(hook)
        self.state = state
        self._buckets = buckets
        self._period = period
        self._warmup_steps = warmup_steps
        self.process_group = process_group
        self.grad_process_group = getattr(ddp_model, "process_group", None) or dist.group.WORLD
        self._check_finite = check_finite
        self._verify = verify
        self._step_count = 0
        self._optimizer_hook = None
        self._removed = False
        self.stats = AveragingStats()

    # --- schedule ---------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls so far."""
        return self._step_count

    @property
    def period(self) -> int:
        return self._period

    @property
    def warmup_steps(self) -> int:
        return self._warmup_steps

    @property
    def in_warmup(self) -> bool:
        """True while ``step_count < warmup_steps``: gradients are still averaged every step."""
        return self._step_count < self._warmup_steps

    @property
    def buckets(self) -> list[ParamBucket]:
        """The buckets built at registration (read-only use)."""
        return list(self._buckets)

    def is_averaging_step(self, step: int | None = None) -> bool:
        """Whether ``step()`` at ``step`` (default: the next one) runs a round."""
        s = self._step_count if step is None else step
        return s >= self._warmup_steps and (s - self._warmup_steps) % self._period == 0

    def step(self) -> bool:
        """Advance the schedule by one optimizer step; average if it says so.

        Collective on the averaging group when it averages. Returns True if it did.
        """
        self._check_alive("step")
        averaged = self.is_averaging_step()
        if averaged:
            self._run_round()
        elif self._step_count == self._warmup_steps - 1:
            # Warm-up kept the replicas identical; start the deltas from here.
            for bucket in self._buckets:
                bucket.reset_anchor()
        self._step_count += 1
        return averaged

    def average(self) -> None:
        """Average now, outside the schedule (collective; the counter does not move)."""
        self._check_alive("average")
        self._run_round()

    # --- the round --------------------------------------------------------------------
    def _error(self, bucket: ParamBucket, what: str) -> AveragingHookError:
        return AveragingHookError(
            f"averaging hook {self._hook_name!r} on bucket {bucket.index()} of "
            f"{len(self._buckets)} (round {self.stats.rounds + 1}, step {self._step_count}): {what}"
        )

    def _run_round(self) -> None:
        start = time.perf_counter()
        try:
            futures = []
            for bucket in self._buckets:
                bucket.start_round()
                try:
                    fut = self._hook(self.state, bucket)
                except Exception as exc:
                    raise self._error(bucket, f"raised {type(exc).__name__}: {exc}") from exc
                if not isinstance(fut, torch._C.Future):
                    raise self._error(
                        bucket,
                        f"returned {type(fut).__name__}; expected a torch.futures.Future "
                        "whose value is the bucket's new flat parameters",
                    )
                futures.append(fut)
            results = [self._result(bucket, fut) for bucket, fut in zip(self._buckets, futures)]
        finally:
            sent = sum(b.take_bytes_sent() for b in self._buckets)
            self.stats.bytes_sent += sent
        # Every bucket's result is valid: only now does anything reach the parameters.
        for bucket, value in zip(self._buckets, results):
            bucket.write_back(value)
        if self._verify:
            self._verify_agreement()
        self.stats.rounds += 1
        self.stats.seconds += time.perf_counter() - start

    def _result(self, bucket: ParamBucket, fut: torch.futures.Future) -> torch.Tensor:
        try:
            value = fut.wait()
        except Exception as exc:
            raise self._error(bucket, f"its future raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, torch.Tensor):
            raise self._error(
                bucket,
                f"its future holds {type(value).__name__}; expected a floating-point tensor "
                f"of {bucket.numel()} elements",
            )
        if not value.is_floating_point():
            raise self._error(
                bucket, f"its future holds a {value.dtype} tensor; expected a floating-point one"
            )
        if value.numel() != bucket.numel():
            raise self._error(
                bucket,
                f"its future holds {value.numel()} elements; expected {bucket.numel()} "
                "(one per parameter element of the bucket)",
            )
        if self._check_finite and not bool(torch.isfinite(value).all()):
            raise self._error(bucket, "result has nan or inf (check_finite=True); nothing written")
        return value

    def _verify_agreement(self) -> None:
        """Compare the step counter and an exact checksum of every bucket across ranks."""
        if not is_member(self.process_group):
            return
        sums = [_checksum(bucket.load_parameters()).cpu() for bucket in self._buckets]
        local = torch.stack([torch.tensor(self._step_count, dtype=torch.int64), *sums])
        if dist.get_backend(self.process_group) == "nccl":
            local = local.to(self._buckets[0].device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(gathered, local, group=self.process_group)
        for rank, other in enumerate(gathered):
            if other[0] != gathered[0][0]:
                raise AveragingHookError(
                    f"verify=True: step counters differ after round {self.stats.rounds + 1} of "
                    f"{self._hook_name!r}: group rank 0 is at step {int(gathered[0][0])}, "
                    f"group rank {rank} at {int(other[0])} (was a step skipped on one rank?)"
                )
            diff = (other[1:] != gathered[0][1:]).nonzero()
            if len(diff):
                raise AveragingHookError(
                    f"verify=True: after round {self.stats.rounds + 1} of {self._hook_name!r}, "
                    f"bucket {int(diff[0])} differs between group ranks 0 and {rank}"
                )

    # --- lifecycle --------------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if self._removed:
            raise RuntimeError(
                f"AveragingHandle.{what}() after remove(): register the hook again to resume"
            )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Run :meth:`step` after every ``optimizer.step()``."""
        self._optimizer_hook = optimizer.register_step_post_hook(lambda *_: self.step())

    def remove(self) -> None:
        """Stop averaging: detach from the optimizer and free the buckets. Idempotent."""
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        self._removed = True
        self._buckets = []

    # --- checkpointing ----------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "hook": self._hook_name,
            "period": self._period,
            "warmup_steps": self._warmup_steps,
            "layout": [b.layout() for b in self._buckets],
        }

    def state_dict(self) -> dict:
        """This rank's averaging state: counter, anchors, hook state, config.

        Plain values and tensors only, so ``torch.save`` takes it.
        """
        self._check_alive("state_dict")
        out = {
            "step_count": self._step_count,
            "config": self._config(),
            "anchors": [b.anchor().clone() if b.has_anchor() else None for b in self._buckets],
            "bucket_memory": [
                {k: v.clone() for k, v in b.memory().items()} for b in self._buckets
            ],
        }
        if hasattr(self.state, "state_dict"):
            out["hook_state"] = self.state.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (on this rank, into a fresh handle).

        Raises ``ValueError`` naming the first difference when the checkpoint was made
        with another hook, period, warm-up or bucket layout; nothing is changed then.
        """
        self._check_alive("load_state_dict")
        if not isinstance(state_dict, dict) or "step_count" not in state_dict:
            raise TypeError(
                "load_state_dict: expected the dict returned by AveragingHandle.state_dict(), "
                f"got {type(state_dict).__name__}"
                + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
            )
        saved = state_dict.get("config", {})
        for key, mine in self._config().items():
            if key in saved and saved[key] != mine:
                raise ValueError(f"load_state_dict: {_difference(key, saved[key], mine)}; "
                                 "register with the same settings to resume")
        anchors = state_dict.get("anchors") or [None] * len(self._buckets)
        for bucket, anchor in zip(self._buckets, anchors):
            if bucket.has_anchor() and anchor is None:
                raise ValueError(
                    f"load_state_dict: bucket {bucket.index()} keeps an anchor but the "
                    "checkpoint has none (was it saved by a handle without keep_anchor?)"
                )
        has_hook_state = hasattr(self.state, "load_state_dict")
        if has_hook_state != ("hook_state" in state_dict):
            raise ValueError(
                "load_state_dict: the checkpoint "
                + ("has no hook state but this hook's state needs one"
                   if has_hook_state else "has a hook state but this hook's state takes none")
            )
        if has_hook_state:
            self.state.load_state_dict(state_dict["hook_state"])
        memories = state_dict.get("bucket_memory") or [{} for _ in self._buckets]
        for bucket, anchor, memory in zip(self._buckets, anchors, memories):
            if bucket.has_anchor():
                bucket.anchor().copy_(anchor)
            bucket.memory().clear()
            bucket.memory().update({k: v.to(bucket.device).clone() for k, v in memory.items()})
        self._step_count = int(state_dict["step_count"])

    def __repr__(self) -> str:
        return (
            f"AveragingHandle(hook={self._hook_name}, period={self._period}, "
            f"warmup_steps={self._warmup_steps}, step_count={self._step_count}, "
            f"buckets={len(self._buckets)})"
        )


def _difference(key: str, theirs, mine) -> str:
    """One sentence naming where a saved or remote config differs from this one."""
    if key == "layout":
        if len(theirs) != len(mine):
            return f"the bucket layout differs: {len(theirs)} buckets there, {len(mine)} here"
        i = next(i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b)
        return f"the bucket layout differs at bucket {i}: {theirs[i]} there, {mine[i]} here"
    return f"{key!r} differs: {theirs!r} there, {mine!r} here"


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _agree_across_ranks(handle: AveragingHandle, group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` checks that all registered the same thing."""
    if not is_member(group) or dist.get_world_size(group) == 1:
        return
    mine = handle._config()
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
        if any(v != values[0] for v in values):
            if key == "layout":
                shown = "; ".join(
                    f"rank {r}: {len(v)} buckets, first {v[0][:2] if v else None}"
                    for r, v in enumerate(values)
                )
            else:
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise ValueError(
                f"register_averaging_hook: ranks disagree on {key!r} (ranks {differ} differ "
                f"from rank 0): {shown}. Every rank must register the same hook, period, "
                "warmup_steps and model"
            )


def register_averaging_hook(
    ddp_model: DistributedDataParallel,
    hook: Callable,
    state,
    *,
    period: int = 1,
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
        period: average every ``period`` steps after the warm-up (``>= 1``).
        warmup_steps: steps before the first round, during which DDP still averages
            gradients (``>= 0``).
        bucket_cap_mb: largest bucket, in MiB (``> 0``); bigger parameters get their own.
        optimizer: if given, :meth:`AveragingHandle.step` runs after each of its steps.
        **options: ``keep_anchor`` (bool, default: the hook's ``needs_anchor`` mark),
            ``check_finite`` (reject a round with nan/inf before writing anything),
            ``verify`` (compare a checksum of the result across ranks after each round),
            ``process_group`` (the group whose ranks must agree; default: the state's
            group, else the default group).

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
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"register_averaging_hook: unknown option(s) {unknown}; accepted: {list(_OPTIONS)}"
        )
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
    keep_anchor = options.get("keep_anchor")
    if keep_anchor is None:
        keep_anchor = bool(hook_attribute(hook, "needs_anchor", False))
    group = _resolve_process_group(state, options.get("process_group"))
    handle = AveragingHandle(
        ddp_model,
        hook,
        state,
        assign_buckets(params, bucket_cap_mb, keep_anchor=bool(keep_anchor)),
        period=period,
        warmup_steps=warmup_steps,
        process_group=group,
        check_finite=bool(options.get("check_finite", False)),
        verify=bool(options.get("verify", False)),
    )
    _agree_across_ranks(handle, group)
    if optimizer is not None:
        handle.attach_optimizer(optimizer)
    return handle
