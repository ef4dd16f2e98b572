"""The round engine: one round, from the hook's launch to the stats and the reports.

One round, in order (:meth:`RoundEngine.launch`, then :meth:`RoundEngine.finish`):

1. **launch**: with weighted time-based rounds, start summing the ranks' local steps
   (:mod:`~ddp_avg_hooks.weights`); for each bucket, begin its round (a
   :class:`~ddp_avg_hooks.bucket.BucketRound`; the parameters are snapshot if the round
   overlaps training) and call ``hook(state, bucket)``; then average the policies'
   extra buckets (buffers, optimizer state) exactly, beside the hook; and run what the
   hooks deferred (``ParamBucket.defer``: second phases, once every bucket's first
   collective is in flight);
2. **collect**: wait for every future and check its value against the hook contract
   (a floating-point tensor of ``bucket.numel()`` elements, finite with
   ``check_finite``), counting the bytes sent even when a check fails; rescale a
   weighted result to the ranks' true total of steps;
3. **write back**: only once every result is valid, let the observers measure, then
   copy the results into the parameters in place (and into the anchors); an
   overlapped round adds the change instead, ``params + (result - params_at_launch)``,
   keeping the progress made while it was in flight. A bucket whose hook called
   ``bucket.mark_result_as_delta()`` returned the averaged change: its new values are
   ``anchor - result``, written in one chunked pass. Then the policies act
   (``optimizer_state="reset"``), the stats are updated and the observers report.

A failed round raises :class:`~ddp_avg_hooks.AveragingHookError` before step 3, so no
parameter changes.

Overlapped rounds (``overlap=True``): the replicas then agree on the anchor, not on the
parameters; each keeps the local steps taken while the round was in flight (up to
``period - 1`` stale steps). Staleness costs loss, since a correction computed at
launch also undoes differences that local training has meanwhile resolved on its own:
keep a round's duration well under the period (a compressed hook, a longer period).
Hooks must read the parameters (``buffer()``, ``delta()``) before they return. The
cross-rank checks of an overlapped round (``verify``, ``track_consensus``) run at the
next round, the first step all ranks are sure to share (:meth:`RoundEngine.report_deferred`).

:func:`run_round` is one blocking round over buckets you built yourself, through the
same two calls: the way to test a hook without a model.

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

import atexit
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from . import ops
from ._groups import or_world
from .bucket import BucketRound, ParamBucket
from .collectives import Background, add_tracked_callback, callbacks_pending, exact_average
from .errors import AveragingHookError
from .observers import Reporter, RoundObserver
from .policies import RoundPolicy, check_buckets_agree
from .protocol import hook_name
from .weights import RoundWeights, WeightExchange

__all__ = ["EXIT_WAIT_SECONDS", "AveragingHookError", "AveragingStats", "Round", "RoundEngine",
           "run_round", "settle_in_flight"]


def _profiler_range(name: str):
    """A ``record_function`` range named ``name`` while a profiler records, else nothing.

    Each phase of a round opens one (``ddp_avg_hooks::round::launch``, ``::wait``,
    ``::write_back``); with no profiler running a range would still cost two operator
    calls on the training thread, so none is opened.

    Example:
        >>> import torch
        >>> with torch.profiler.profile() as prof:
        ...     with _profiler_range("ddp_avg_hooks::example"):
        ...         pass
        >>> "ddp_avg_hooks::example" in {e.name for e in prof.events()}
        True
        >>> type(_profiler_range("ddp_avg_hooks::example")).__name__  # not profiling
        'nullcontext'
    """
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()


@dataclasses.dataclass
class AveragingStats:
    """What averaging has cost so far on this rank.

    Attributes:
        rounds: averaging rounds completed.
        bytes_sent: bytes of the tensors this rank handed to collectives for averaging
            (as recorded by hooks with ``bucket.record_sent``, plus buffers and
            optimizer state when those are averaged).
        seconds: wall-clock seconds spent in rounds (copies, hooks, waits, write-back).
        wait_seconds: the part of ``seconds`` spent waiting for hooks' futures.
        last_round_bytes: ``bytes_sent`` of the latest round.
        consensus_distance: with ``track_consensus=True``, the mean over replicas of
            ``||params_r - average||^2`` (all parameters; with FSDP2 every shard of the
            replica, the same on every rank) at the latest round.
    """

    rounds: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    last_round_bytes: int = 0
    consensus_distance: float | None = None

    @property
    def bytes_per_round(self) -> float:
        """Mean bytes this rank sent per round."""
        return self.bytes_sent / self.rounds if self.rounds else 0.0


@dataclasses.dataclass(eq=False)
class Round:
    """One round: what :meth:`RoundEngine.launch` started, then what it collected.

    Attributes:
        where: ``"round N, step S"``, for messages.
        buckets: the buckets it averages; ``records`` their :class:`BucketRound`.
        futures: the hook's futures, one per bucket.
        changes: per bucket, whether its result is ``anchor - new``.
        extras: the policies' buckets (averaged exactly); ``extra_futures`` theirs.
        overlapped: it runs while training goes on.
        fragment: the fragment it averages (``None``: every bucket).
        weights: the ranks' step counts in flight (a weighted round), if any.
        completed_at: when its last future completed (see :meth:`record_completion`).
        launch_step: the handle's step count at launch (set by the handle).
        results: the checked results, once collected (``extra_results`` likewise).
        bytes_sent: bytes this rank sent, set when collected (even if a check failed).
        wait_seconds: seconds spent waiting for its futures.
    """

    where: str
    buckets: list[ParamBucket]
    records: list[BucketRound]
    futures: list
    changes: list[bool]
    extras: list[ParamBucket]
    extra_futures: list
    started: float
    overlapped: bool
    fragment: int | None = None
    weights: WeightExchange | None = None
    completed_at: float | None = None
    launch_step: int | None = None
    results: list[torch.Tensor] | None = None
    extra_results: list[torch.Tensor] | None = None
    bytes_sent: int = 0
    wait_seconds: float = 0.0

    def done(self) -> bool:
        """Whether every future (and the weight exchange) has completed."""
        return all(f.done() for f in self.futures + self.extra_futures) and \
            (self.weights is None or self.weights.done())

    def record_completion(self, clock: Callable[[], float]) -> None:
        """Set ``completed_at`` to ``clock()`` when the round's last future completes."""
        def completed(_) -> None:
            self.completed_at = clock()

        works = [] if self.weights is None else [self.weights.work.get_future()]
        for fut in self.futures + self.extra_futures + works:
            add_tracked_callback(fut, completed)


_PEER_SIGNS = ("timed out", "timeout", "connection", "reset by peer", "closed", "broken pipe",
               "aborted", "no route")


def likely_cause(what: str) -> str:
    """The likely cause of a collective's failure, from its message ("" if it names none)."""
    if not any(sign in what.lower() for sign in _PEER_SIGNS):
        return ""
    return (". Likely cause: a peer rank died, stopped calling step(), or is in another "
            "round (every rank of the group must run the same rounds); the first error on "
            "the other ranks tells which. How soon it is noticed is the process group's "
            "timeout")


class RoundEngine:
    """Runs rounds of one hook over a fixed list of buckets.

    Args:
        hook: ``hook(state, bucket) -> Future[Tensor]``.
        state: passed to every hook call.
        buckets: the buckets, in launch order.
        exact_group: the averaging group: the policies' exact averages and the ranks'
            step counts go over it (``None``: the default group).
        check_finite: reject a round whose results hold nan or inf.
        fragments: ``buckets`` cut into consecutive parts that rounds may average one
            at a time (default: one part, all buckets).
        mixing: how an overlapped round is applied (see :meth:`ParamBucket.apply`).
        linear: the hook is declared ``linear`` (see :class:`~ddp_avg_hooks.HookSpec`).
        weighted: rounds weigh ranks by their local steps (``EverySeconds(weighting="steps")``).
        policies: what else a round does to the model (:mod:`~ddp_avg_hooks.policies`).
        observers: what looks at a finished round (:mod:`~ddp_avg_hooks.observers`).

    ``stats`` is the :class:`AveragingStats` the rounds update; ``weights`` each
    fragment's last total of local steps (:class:`~ddp_avg_hooks.weights.RoundWeights`).
    """

    def __init__(self, hook: Callable, state, buckets: Sequence[ParamBucket], *,
                 exact_group=None, check_finite: bool = False,
                 fragments: Sequence[Sequence[ParamBucket]] | None = None,
                 mixing: float | None = None, linear: bool = False, weighted: bool = False,
                 policies: Sequence[RoundPolicy] = (),
                 observers: Sequence[RoundObserver] = ()) -> None:
        self.hook, self.state = hook, state
        self.name = hook_name(hook)
        self.buckets = list(buckets)
        self.fragments = [list(f) for f in fragments] if fragments else [self.buckets]
        self.exact_group = or_world(exact_group)
        self.check_finite, self.mixing, self.linear = check_finite, mixing, linear
        self.policies = list(policies)
        self.reporter = Reporter(list(observers))
        self.stats = AveragingStats()
        #: the registration's background thread and private groups (see ``ParamBucket.defer``)
        self.background = Background()
        world = dist.get_world_size(self.exact_group) if dist.is_initialized() else 1
        self.weighted = weighted and world > 1
        self.weights = RoundWeights(world=world, fragments=len(self.fragments), linear=linear)

    @property
    def collective_reports(self) -> bool:
        """Whether an observer's report talks to the other ranks (``verify``,
        ``track_consensus``)."""
        return any(o.collective for o in self.reporter.observers)

    def error(self, bucket: ParamBucket, where: str, what: str) -> AveragingHookError:
        return AveragingHookError(
            f"averaging hook {self.name!r} on bucket {bucket.index()} of "
            f"{len(self.buckets)} ({where}): {what}{likely_cause(what)}"
        )

    # --- launch --------------------------------------------------------------------------
    def launch(self, *, overlapped: bool = False, where: str = "round",
               fragment: int | None = None, local_steps: int | None = None) -> Round:
        """Start a round of ``fragment`` (``None``: every bucket, outside the schedule).

        ``local_steps``: this rank's steps since the fragment's last round, its weight
        in a weighted round (ignored unless the engine is ``weighted``). The hook then
        sees its parameters' change since the anchor scaled by ``n * w / W`` (``buffer()
        = anchor + scale * (params - anchor)``, ``delta()`` likewise; the parameters
        themselves are untouched), so that a plain average becomes a weighted one.
        """
        started = time.perf_counter()
        buckets = self.buckets if fragment is None else self.fragments[fragment]
        # the policies' extras (buffers, optimizer state) go with the first fragment
        extras = [b for p in self.policies for b in p.buckets()] if not fragment else []
        for bucket in (*buckets, *extras):  # before anything starts: a refusal changes nothing
            bucket.check_parameters()
        scale, exchange = 1.0, None
        if self.weighted and fragment is not None:
            scale, exchange = self.weights.start(local_steps, fragment, self.exact_group, where)
        if not fragment and any(p.changing for p in self.policies):
            check_buckets_agree(self.policies, extras, self.exact_group, where)
        with _profiler_range("ddp_avg_hooks::round::launch"):
            futures, records, deferred, background = [], [], [], []
            for bucket in buckets:
                record = bucket.begin_round(scale, overlapped=overlapped,
                                            background=self.background)
                futures.append(self._call_hook(bucket, where))
                records.append(record)
                deferred += [(bucket, fn) for fn in record.take_deferred()]
                background += record.take_background()
            changes = [r.result_is_delta for r in records]
            extra_futures = []
            for bucket in extras:
                records.append(bucket.begin_round(overlapped=overlapped))
                extra_futures.append(exact_average(self.exact_group, bucket))
            self._run_deferred(deferred, where)
            for fn in background:  # in bucket order: the same on every rank
                self.background.submit(fn)
        rnd = Round(where, list(buckets), records, futures, changes, extras, extra_futures,
                    started, overlapped, fragment=fragment, weights=exchange)
        if overlapped:
            _track(rnd, self)
        return rnd

    def _call_hook(self, bucket: ParamBucket, where: str):
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

    # --- finish ----------------------------------------------------------------------------
    def finish(self, rnd: Round, handle=None) -> Round:
        """Collect ``rnd``, check it, write it back, update the stats and report.

        ``handle`` is what the observers' reports receive (``on_round``'s argument);
        raises :class:`AveragingHookError`, with nothing written, if the round failed.
        """
        _IN_FLIGHT.pop(rnd, None)
        try:
            factor = 1.0 if rnd.weights is None else self.weights.correction(rnd.weights, rnd.where)
            self._collect(rnd)
        finally:
            self.stats.bytes_sent += rnd.bytes_sent
            self.stats.last_round_bytes = rnd.bytes_sent
        self.stats.wait_seconds += rnd.wait_seconds
        if factor != 1.0:
            self._rescale(rnd, factor)
        measured = self.reporter.measure(rnd.buckets, rnd)
        with _profiler_range("ddp_avg_hooks::round::write_back"), torch.no_grad():
            for bucket, value, change in zip(rnd.buckets, rnd.results, rnd.changes):
                bucket.apply(value, is_delta=change, overlapped=rnd.overlapped, mixing=self.mixing)
            # the policies' buffers and state take the parameters' rule; what can't be
            # negative (a second moment, a running variance) stays so
            for bucket, value in zip(rnd.extras, rnd.extra_results):
                bucket.apply(value, overlapped=rnd.overlapped, mixing=self.mixing,
                             keep_nonnegative=True)
        for policy in self.policies:
            policy.after_write_back()
        self.stats.rounds += 1
        # Ranks apply an overlapped round at different steps, so its collective reports
        # wait for a step every rank shares: the next round (or average()).
        self.reporter.report_collective(handle, self.stats.rounds, measured,
                                        overlapped=rnd.overlapped)
        self.stats.seconds += time.perf_counter() - rnd.started
        self.reporter.report_local(handle, self.stats.rounds, measured)
        return rnd

    def report_deferred(self, handle=None) -> None:
        """Run the collective reports an overlapped round left (at a step all ranks share)."""
        self.reporter.report_deferred(handle)

    def _collect(self, rnd: Round) -> None:
        """Wait for the round and check every result; raises :class:`AveragingHookError`."""
        wait_start = time.perf_counter()
        try:
            with _profiler_range("ddp_avg_hooks::round::wait"):
                rnd.results = [self._result(b, f, rnd.where)
                               for b, f in zip(rnd.buckets, rnd.futures)]
                rnd.extra_results = [f.wait() for f in rnd.extra_futures]
        finally:
            rnd.bytes_sent = sum(r.bytes_sent for r in rnd.records)
            rnd.wait_seconds = time.perf_counter() - wait_start

    @staticmethod
    def _rescale(rnd: Round, factor: float) -> None:
        """Multiply each result's change from its bucket's anchor by ``factor``, in place."""
        for bucket, value, change in zip(rnd.buckets, rnd.results, rnd.changes):
            if change:
                value.mul_(factor)
            else:
                anchor = bucket.anchor()
                torch.add(anchor, value.sub_(anchor), alpha=factor, out=value)

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
        if not value.is_floating_point() or value.dtype not in ops.SUPPORTED_DTYPES:
            raise self.error(
                bucket, where, f"its future holds a {value.dtype} tensor; expected one of "
                f"{', '.join(str(d) for d in ops.SUPPORTED_DTYPES)}")
        if value.numel() != bucket.numel():
            raise self.error(
                bucket, where,
                f"its future holds {value.numel()} elements; expected {bucket.numel()} "
                "(one per parameter element of the bucket)",
            )
        if value.is_meta:
            raise self.error(bucket, where, "its future holds a tensor on the meta device, "
                             "which has no values; return the bucket's new values")
        device = bucket.device
        if value.device != device:
            raise self.error(bucket, where, f"its future holds a tensor on {value.device}, "
                             f"the parameters are on {device}; return it there "
                             f"(.to({str(device)!r}))")
        if value.dim() != 1 or not value.is_contiguous():
            value = value.reshape(-1).contiguous()  # a strided or shaped view: its values, flat
        if self.check_finite and not bool(torch.isfinite(value).all()):
            raise self.error(bucket, where,
                             "result has nan or inf (check_finite=True); nothing written")
        return value


#: the longest an exiting interpreter waits for the overlapped rounds still in flight
EXIT_WAIT_SECONDS = 10.0
# every overlapped round launched and not finished, with its engine, whether or not its
# handle is still referenced (a training function that returned dropped it): the
# interpreter's exit waits for them (those seen settled are dropped at the next launch)
_IN_FLIGHT: dict[Round, RoundEngine] = {}


def _settled(rnd: Round, engine: RoundEngine) -> bool:
    return rnd.done() and engine.background.drain(0)


def _track(rnd: Round, engine: RoundEngine) -> None:
    for old, its_engine in list(_IN_FLIGHT.items()):
        if _settled(old, its_engine):
            _IN_FLIGHT.pop(old, None)
    _IN_FLIGHT[rnd] = engine


def settle_in_flight(deadline: float) -> int:
    """Wait until every overlapped round in flight in this process has completed, its
    engine's background thread has run every call handed to it and torch has run and let
    go the hooks' callbacks (``collectives.callbacks_pending()``), or until
    ``deadline`` (a ``time.monotonic()`` value); collects and applies nothing. Returns
    how many rounds had not settled by then.

    The interpreter's exit runs it, for up to :data:`EXIT_WAIT_SECONDS`: a thread still
    inside a torch call as Python finalizes (a collective the background thread issued,
    a round's callback on gloo's thread) is ended as it takes the GIL back, and that
    aborts the process ("terminate called without an active exception").

    Example:
        >>> import time
        >>> settle_in_flight(time.monotonic() + 1.0)  # no round in flight
        0
    """
    while True:
        late = [r for r, e in list(_IN_FLIGHT.items()) if not _settled(r, e)]
        left = deadline - time.monotonic()
        if not (late or callbacks_pending()) or left <= 0:
            return len(late)
        time.sleep(min(0.001, left))


# after the rounds settle, torch's threads still release what a hook's own callbacks
# (``then()``, ``add_done_callback``) held, taking the GIL for it, microseconds later
_EXIT_GRACE_SECONDS = 0.05


def _settle_at_exit() -> None:
    waited = bool(_IN_FLIGHT) or callbacks_pending() > 0
    late = settle_in_flight(time.monotonic() + EXIT_WAIT_SECONDS)
    if waited and not late:
        time.sleep(_EXIT_GRACE_SECONDS)
    if late:
        sys.stderr.write(
            f"ddp_avg_hooks: {late} overlapped round(s) still in flight "
            f"{EXIT_WAIT_SECONDS:g} s after the program ended (a rank that stopped early "
            "leaves its peers' rounds unanswered); the process may abort as it exits. End "
            "training with handle.remove() on every rank.\n")


atexit.register(_settle_at_exit)


def run_round(hook: Callable, state, buckets: Sequence[ParamBucket], *,
              between: Callable[[], None] | None = None) -> Round:
    """One blocking round of ``hook`` over ``buckets``, as a registration runs it.

    ``between`` runs after the launch and before the wait (say, another collective
    that must not interleave with the hook's). Returns the written-back :class:`Round`
    (its ``bytes_sent`` is what the hook recorded).
    """
    engine = RoundEngine(hook, state, buckets)
    rnd = engine.launch()
    if between is not None:
        between()
    return engine.finish(rnd)
