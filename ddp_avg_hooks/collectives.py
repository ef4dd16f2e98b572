"""The collectives every round is built from: a completed future, a sum and an exact average.

The built-in hooks and the round engine (which averages buffers and optimizer state
exactly, beside the hook) share them, so an exact average is one piece of code.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.collectives import completed
    >>> completed(torch.ones(2)).wait().tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import queue
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from ._groups import is_member

__all__ = ["Background", "add_tracked_callback", "allreduce_sum", "backend_device",
           "callbacks_pending", "completed", "exact_average", "gather_small", "group_timeout",
           "tracked_then"]


def completed(value) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


_TRACKED_LOCK = threading.Lock()
# one entry per callable handed to torch: a weak reference to it, what it calls and, for
# tracked_then(), the future it completes. They are held here, so that torch's thread,
# dropping the callable after it ran, frees nothing else (no Python code runs there); a
# thread of ours drops them once torch has let the callable go.
_TRACKED: list[list] = []
# attaching a callback looks for the let-go entries once the registry has doubled since
# the last look (at least 64 entries), so a round of many buckets costs no more per callback
_prune_at = 64


def _prune() -> list[list]:
    """Take the entries whose callable torch has freed out of the registry (under the
    lock); the caller drops them outside it."""
    global _prune_at
    dead = [e for e in _TRACKED if e[0]() is None]
    if dead:
        _TRACKED[:] = [e for e in _TRACKED if e[0]() is not None]
    _prune_at = max(64, 2 * len(_TRACKED))
    return dead


def _tracked(fn) -> tuple:
    def run(f):
        return fn(f)

    entry = [weakref.ref(run), fn, None]
    dead = []
    with _TRACKED_LOCK:
        if len(_TRACKED) >= _prune_at:
            dead = _prune()
        _TRACKED.append(entry)
    del dead  # outside the lock: what the dropped callbacks held may run code as it goes
    return run, entry


def add_tracked_callback(fut: torch.futures.Future, fn) -> None:
    """``fut.add_done_callback(fn)``, counted by :func:`callbacks_pending` from now until
    torch has run the callback and let it go. The callback may run on a thread of
    torch's (gloo's), after ``fut`` is seen complete, and torch takes the GIL back there
    once more to release it; the interpreter's exit waits for both, since a thread of
    torch's that takes the GIL as Python finalizes aborts the process ("terminate called
    without an active exception"). What ``fn`` holds is released on a thread of ours.

    Example:
        >>> fut = torch.futures.Future()
        >>> add_tracked_callback(fut, lambda f: None); callbacks_pending()
        1
        >>> fut.set_result(0); callbacks_pending()
        0
    """
    run, _ = _tracked(fn)
    fut.add_done_callback(run)


def tracked_then(fut: torch.futures.Future, fn) -> torch.futures.Future:
    """``fut.then(fn)``, counted by :func:`callbacks_pending` like
    :func:`add_tracked_callback`: a future of ``fn(fut)``. Hooks chain their collectives'
    futures with it, so that a program may end right after a round.

    Example:
        >>> fut = torch.futures.Future()
        >>> doubled = tracked_then(fut, lambda f: f.value() * 2); callbacks_pending()
        1
        >>> fut.set_result(torch.ones(2)); doubled.wait().tolist(), callbacks_pending()
        ([2.0, 2.0], 0)
    """
    run, entry = _tracked(fn)
    entry[2] = child = fut.then(run)
    return child


def callbacks_pending() -> int:
    """How many callbacks :func:`add_tracked_callback` and :func:`tracked_then` attached
    torch has not run and let go yet. What those torch has let go held is dropped here,
    on the calling thread (and as callbacks are attached): ``handle.remove()`` calls it,
    so that the buffers a registration's last rounds used are freed with it."""
    with _TRACKED_LOCK:
        dead = _prune()
        pending = len(_TRACKED)
    del dead
    return pending


def allreduce_sum(group: dist.ProcessGroup, tensor: torch.Tensor, bucket) -> torch.futures.Future:
    """Sum ``tensor`` in place across ``group``, counting its bytes on ``bucket``; a future
    of it."""
    bucket.record_sent(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return tracked_then(work.get_future(), lambda fut: fut.value()[0])


def exact_average(group: dist.ProcessGroup, bucket) -> torch.futures.Future:
    """A future of the mean over ``group`` of ``bucket``'s parameters: divide, then sum.

    The same arithmetic as PyTorch's ``average_parameters``. When ``1 / world_size`` is
    exact (a power of two), the division is fused into the copy of the parameters,
    which gives the same bits. A rank outside ``group`` gets its own parameters back.
    """
    if not is_member(group):
        return completed(bucket.buffer())
    world_size = dist.get_world_size(group)
    if world_size & (world_size - 1) == 0:
        buffer = bucket.scaled_buffer(1.0 / world_size)
    else:
        buffer = bucket.buffer().div_(world_size)
    return allreduce_sum(group, buffer, bucket)


def backend_device(group) -> torch.device:
    """The device ``group``'s backend communicates from: the current CUDA device for
    NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout(group) -> timedelta | None:
    """The timeout ``group``'s collectives run under (``init_process_group(timeout=)`` for
    the default group), or ``None`` when its backend does not say (torch's default then).

    Example:
        >>> import datetime, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
        ...                         timeout=datetime.timedelta(seconds=42))
        >>> group_timeout(dist.group.WORLD)
        datetime.timedelta(seconds=42)
        >>> dist.destroy_process_group()
    """
    try:
        timeout = group._get_backend(backend_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def gather_small(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (a few numbers, on the CPU) over ``group``, in group rank
    order: a blocking all-gather on the device the group's backend needs (CUDA for NCCL).

    Example:
        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> [t.tolist() for t in gather_small(torch.tensor([3, 4]), dist.group.WORLD)]
        [[3, 4]]
        >>> dist.destroy_process_group()
    """
    tensor = tensor.to(backend_device(group))
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


# the private groups of closed registrations, by (ranks, timeout), for the next ones:
# destroying a group would free its name (made from its ranks), and a new group of that
# name meets the old one's addresses, still in the store, as it connects
_SPARE_GROUPS: dict[tuple, list[dist.ProcessGroup]] = {}


def _spare_group(ranks: tuple, timeout) -> dist.ProcessGroup | None:
    """A closed registration's private group over ``ranks`` with ``timeout``, still
    registered with torch (not destroyed with the world since), or ``None``."""
    spares = _SPARE_GROUPS.get((ranks, timeout), [])
    while spares:
        group = spares.pop()
        try:
            if tuple(dist.get_process_group_ranks(group)) == ranks:
                return group
        except KeyError:  # destroyed with the world since
            pass
    return None


class Background:
    """A registration's background thread and its private process groups.

    A hook whose second collective depends on its first (an all-to-all, then an
    all-gather) would otherwise wait for the first in the training thread. In a round that
    overlaps training it may hand that second phase to this thread instead
    (``bucket.defer(fn, background=True)``): the calls run one at a time, in the order they
    were handed over, which is the rounds' launch order and the same on every rank. They
    may issue collectives only on :meth:`private` groups, duplicates of the averaging
    groups that only this registration uses, so no collective of theirs can pair with one
    the training thread issues meanwhile (gloo and NCCL pair collectives by the order each
    rank issues them on a group).

    The thread starts at the first call handed over; :meth:`close` stops it (a removed
    registration's) and passes the private groups on, else it stops with the process (a
    daemon).

    Example:
        >>> done = []
        >>> bg = Background()
        >>> bg.in_use
        False
        >>> bg.submit(lambda: done.append(1)); bg.drain()  # True: every call has run
        True
        >>> done, bg.in_use
        ([1], True)
        >>> bg.close(), bg.in_use  # True: the thread stopped
        (True, False)
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._groups: dict[tuple, dist.ProcessGroup] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> bool:
        """Whether a call was ever handed over or a private group made (a hook's rounds
        that need neither leave the registration without a thread or a group)."""
        return self._queue is not None or bool(self._groups)

    def private(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """This registration's duplicate of ``group`` (made at the first call, collective
        over ``group``'s members only: every member must ask for it at the same round),
        with ``group``'s timeout, so a collective that a lost rank leaves unanswered fails
        as soon as one on ``group`` would."""
        ranks = tuple(dist.get_process_group_ranks(group))
        private = self._groups.get(ranks)
        if private is None:
            timeout = group_timeout(group)
            private = self._groups[ranks] = _spare_group(ranks, timeout) or dist.new_group(
                list(ranks), timeout=timeout, use_local_synchronization=True,
                group_desc="ddp_avg_hooks_background")
        return private

    def submit(self, fn) -> None:
        """Run ``fn()`` on the background thread, after every call submitted before it.
        ``fn`` must report its own failure (complete its hook's future with the exception)."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._queue,),
                                            name="ddp_avg_hooks-background", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(fn)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted call has run; ``False`` if ``timeout`` passed first."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread once every call handed to it has run (waiting up to
        ``timeout`` seconds), and hand the private groups on to the next registration
        over the same ranks and timeout, which then makes none of its own: removed
        registrations leave no thread behind, and no gloo group beyond the most that
        were live at once. Every rank must close and make registrations in the same
        order (as it registers and removes them). Returns ``False``, keeping the groups,
        if a call was still running at the timeout (a collective of it unanswered). A
        call handed over later starts a new thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._queue = self._thread = None
        for ranks, group in self._groups.items():
            _SPARE_GROUPS.setdefault((ranks, group_timeout(group)), []).append(group)
        self._groups.clear()
        return True

    def _run(self, calls: queue.SimpleQueue) -> None:
        while (fn := calls.get()) is not None:
            try:
                fn()
            except Exception:  # fn reports its failure through its hook's future
                pass
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.set()
