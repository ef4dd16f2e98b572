"""The round engine: launch a hook on every bucket, check what comes back, write it back.

One round, in order:

1. **launch**: for each bucket, mark its buffer stale, snapshot the parameters if the
   round overlaps training, call ``hook(state, bucket)``; then average the policies'
   extra buckets (buffers, optimizer state) exactly, beside the hook;
   and run what the hooks deferred (``ParamBucket.defer``: second phases, once every
   bucket's first collective is in flight);
2. **collect**: wait for every future and check its value against the hook contract
   (a floating-point tensor of ``bucket.numel()`` elements, finite with
   ``check_finite``), counting the bytes sent even when a check fails;
3. **write back**: only once every result is valid, copy the results into the
   parameters in place (and into the anchors); an overlapped round adds the change
   instead, ``params + (result - params_at_launch)``, keeping the progress made while
   it was in flight. A bucket whose hook called ``bucket.mark_result_as_delta()``
   returned the averaged change: its new values are ``anchor - result``, written in
   one chunked pass.

A failed round raises :class:`AveragingHookError` before step 3, so no parameter
changes.

Overlapped rounds (``overlap=True``): the replicas then agree on the anchor, not on the
parameters; each keeps the local steps taken while the round was in flight (up to
``period - 1`` stale steps). Staleness costs loss, since a correction computed at
launch also undoes differences that local training has meanwhile resolved on its own:
keep a round's duration well under the period (a compressed hook, a longer period).
Hooks must read the parameters (``buffer()``, ``delta()``) before they return. The
cross-rank checks of an overlapped round (``verify``, ``track_consensus``) run at the
next round, the first step all ranks are sure to share. :func:`run_round` is one blocking round over buckets you built yourself, the
way to test a hook without a model.

Example:
    >>> import torch, torch.distributed as dist
    >>> import ddp_avg_hooks as dah
    >>> from ddp_avg_hooks.bucket import ParamBucket
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> done = dah.rounds.run_round(dah.hooks.fp16_compress_hook, None,
    ...                             [ParamBucket(0, [w], is_last=True, keep_anchor=True)])
    >>> done.bytes_sent, w.tolist()
    (6, [1.0, 1.0, 1.0])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from torch.autograd.profiler import record_function

from .bucket import ParamBucket
from .hooks.default import allreduce_hook
from .protocol import hook_name


class AveragingHookError(RuntimeError):
    """An averaging hook failed or returned something other than the contract says."""


@dataclasses.dataclass(eq=False)
class PendingRound:
    """A launched round: the hook's futures and those of the exact extra buckets."""

    futures: list
    buckets: list[ParamBucket]
    extras: list[ParamBucket]
    extra_futures: list
    started: float
    overlapped: bool
    where: str
    changes: list[bool]  # per bucket: whether its result is ``anchor - new``
    fragment: int | None = None  # the fragment it averages (None: every bucket)
    bytes_sent: int = 0  # set by collect(), even when a check fails
    weights: object = None  # the ranks' step counts in flight (a weighted round), if any
    completed_at: float | None = None  # see record_completion

    def done(self) -> bool:
        return all(f.done() for f in self.futures + self.extra_futures) and \
            (self.weights is None or self.weights.done())

    def record_completion(self, clock: Callable[[], float]) -> None:
        """Set ``completed_at`` to ``clock()`` when the round's last future completes."""
        def completed(_) -> None:
            self.completed_at = clock()

        works = [] if self.weights is None else [self.weights.work.get_future()]
        for fut in self.futures + self.extra_futures + works:
            fut.add_done_callback(completed)


@dataclasses.dataclass
class FinishedRound:
    """A collected round: checked results, not yet written back."""

    results: list[torch.Tensor]
    extra_results: list[torch.Tensor]
    overlapped: bool
    bytes_sent: int
    wait_seconds: float
    started: float
    changes: list[bool]  # per result: whether it is ``anchor - new``


class RoundEngine:
    """Runs rounds of one hook over a fixed list of buckets.

    Args:
        hook: ``hook(state, bucket) -> Future[Tensor]``.
        state: passed to every hook call.
        buckets: the buckets, in launch order.
        exact_group: the process group of the extra buckets' exact average.
        check_finite: reject a round whose results hold nan or inf.
        fragments: ``buckets`` cut into consecutive parts that rounds may average one
            at a time (default: one part, all buckets).
        mixing: how an overlapped round is applied (see :meth:`ParamBucket._write_back_with_progress`).
        linear: the hook is declared ``linear`` (see :class:`~ddp_avg_hooks.HookSpec`).
    """

    def __init__(self, hook: Callable, state, buckets: Sequence[ParamBucket], *,
                 exact_group=None, check_finite: bool = False,
                 fragments: Sequence[Sequence[ParamBucket]] | None = None,
                 mixing: float | None = None, linear: bool = False) -> None:
        self.linear = linear
        self.hook, self.state = hook, state
        self.name = hook_name(hook)
        self.buckets = list(buckets)
        self.fragments = [list(f) for f in fragments] if fragments else [self.buckets]
        self.mixing = mixing
        self.exact_group = exact_group
        self.check_finite = check_finite

    def error(self, bucket: ParamBucket, where: str, what: str) -> AveragingHookError:
        return AveragingHookError(
            f"averaging hook {self.name!r} on bucket {bucket.index()} of "
            f"{len(self.buckets)} ({where}): {what}"
        )

    def launch(self, *, overlapped: bool = False, extras: Sequence[ParamBucket] = (),
               where: str = "round", fragment: int | None = None,
               delta_scale: float = 1.0) -> PendingRound:
        """Call the hook on every bucket (of ``fragment`` only, if given), then start
        the extras' exact average.

        ``delta_scale`` weighs this rank: the hook sees its parameters' change since the
        anchor scaled by it (``buffer() = anchor + delta_scale * (params - anchor)``,
        ``delta()`` likewise; the parameters themselves are untouched), so that a plain
        average becomes a weighted one.
        """
        started = time.perf_counter()
        buckets = self.buckets if fragment is None else self.fragments[fragment]
        with record_function("ddp_avg_hooks::round::launch"):
            futures, deferred = [], []
            for b in buckets:
                futures.append(self._call_hook(b, overlapped, where, delta_scale))
                deferred += [(b, fn) for fn in b._take_deferred()]
            changes = [b._result_is_delta for b in buckets]
            extras = list(extras)
            extra_futures = []
            for bucket in extras:
                bucket._start_round()
                extra_futures.append(allreduce_hook(self.exact_group, bucket))
            self._run_deferred(deferred, where)
        return PendingRound(futures, list(buckets), extras, extra_futures, started, overlapped,
                            where, changes, fragment=fragment)

    def _run_deferred(self, deferred: list, where: str) -> None:
        """Run the calls the hooks deferred (``ParamBucket.defer``), in order, all of them
        even if one raises (the others' collectives must still be issued); then raise
        the first failure."""
        failure = None
        for bucket, fn in deferred:
            try:
                fn()
            except Exception as exc:
                if failure is None:
                    failure = self.error(bucket, where,
                                         f"its deferred call raised {type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
        if failure is not None:
            raise failure

    def _call_hook(self, bucket: ParamBucket, overlapped: bool, where: str, delta_scale: float):
        bucket._start_round(delta_scale, overlapped=overlapped)
        if overlapped:
            bucket._snapshot_launch()
        try:
            fut = self.hook(self.state, bucket)
        except Exception as exc:
            raise self.error(bucket, where, f"raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(fut, torch._C.Future):
            raise self.error(
                bucket, where,
                f"returned {type(fut).__name__}; expected a torch.futures.Future "
                "whose value is the bucket's new flat parameters",
            )
        return fut

    def collect(self, pending: PendingRound) -> FinishedRound:
        """Wait for the round and check every result; raises :class:`AveragingHookError`."""
        wait_start = time.perf_counter()
        try:
            with record_function("ddp_avg_hooks::round::wait"):
                results = [self._result(b, f, pending.where)
                           for b, f in zip(pending.buckets, pending.futures)]
                extra_results = [f.wait() for f in pending.extra_futures]
        finally:
            pending.bytes_sent = sum(b._take_bytes_sent() for b in pending.buckets + pending.extras)
        return FinishedRound(results, extra_results, pending.overlapped, pending.bytes_sent,
                             time.perf_counter() - wait_start, pending.started,
                             pending.changes)

    @staticmethod
    def rescale(pending: PendingRound, finished: FinishedRound, factor: float) -> None:
        """Multiply each result's change from its bucket's anchor by ``factor``, in place."""
        for bucket, value, change in zip(pending.buckets, finished.results, finished.changes):
            if change:
                value.mul_(factor)
            else:
                anchor = bucket._anchor_for_op()
                torch.add(anchor, value.sub_(anchor), alpha=factor, out=value)

    def write_back(self, pending: PendingRound, finished: FinishedRound) -> None:
        """Copy the results into the parameters in place (all of them valid by now)."""
        with record_function("ddp_avg_hooks::round::write_back"):
            for bucket, value, change in zip(pending.buckets, finished.results,
                                             finished.changes):
                if finished.overlapped:
                    new = bucket._new_values(value) if change else value
                    bucket._write_back_with_progress(new, self.mixing)
                elif change:
                    bucket._write_back_delta(value)
                else:
                    bucket._write_back(value)
            for bucket, value in zip(pending.extras, finished.extra_results):
                bucket._write_back(value)

    def _result(self, bucket: ParamBucket, fut, where: str) -> torch.Tensor:
        try:
            value = fut.wait()
        except Exception as exc:
            raise self.error(bucket, where,
                             f"its future raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, torch.Tensor):
            raise self.error(
                bucket, where,
                f"its future holds {type(value).__name__}; expected a floating-point tensor "
                f"of {bucket.numel()} elements",
            )
        if not value.is_floating_point():
            raise self.error(bucket, where, f"its future holds a {value.dtype} tensor; "
                             "expected a floating-point one")
        if value.numel() != bucket.numel():
            raise self.error(
                bucket, where,
                f"its future holds {value.numel()} elements; expected {bucket.numel()} "
                "(one per parameter element of the bucket)",
            )
        if self.check_finite and not bool(torch.isfinite(value).all()):
            raise self.error(bucket, where,
                             "result has nan or inf (check_finite=True); nothing written")
        return value


def run_round(hook: Callable, state, buckets: Sequence[ParamBucket], *,
              between: Callable[[], None] | None = None) -> FinishedRound:
    """One blocking round of ``hook`` over ``buckets``, as a registration runs it.

    ``between`` runs after the launch and before the wait (say, another collective
    that must not interleave with the hook's). Returns the written-back round (its
    ``bytes_sent`` is what the hook recorded).
    """
    engine = RoundEngine(hook, state, buckets)
    pending = engine.launch()
    if between is not None:
        between()
    finished = engine.collect(pending)
    engine.write_back(pending, finished)
    return finished
