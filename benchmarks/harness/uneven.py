"""Uneven workers: per-step jitter and one persistently slow rank.

Two modes, combined with a network profile as ``<profile>+<mode>`` in
``bench_train.py --profiles`` (or ``--uneven jitter,slow-rank``):

- ``jitter``: every step of every rank is stretched by an independent random factor
  ``f = exp(sigma * z)``, ``z ~ N(0, 1)``, seeded per rank: after the step's compute
  the rank **sleeps** ``compute * (max(1, f) - 1)`` seconds (an emulation: the CPU is
  idle during it). ``sigma`` is 0.3.
- ``slow-rank``: one rank is ``factor`` (1.5) times slower for the whole run, by a real
  limit: a CPU quota on that rank's process (one torch thread), ``quota = period /
  factor`` with a 10 ms period. The benchmark (root) creates the cgroup, moves the
  rank's process into it as soon as it appears (found by its command line and ``RANK``),
  and removes it afterwards (pids moved back, ``rmdir``) even on failure. cgroup v2
  ``cpu.max`` is tried first, then cgroup v1 ``cpu.cfs_quota_us``; without either the
  rank sleeps ``compute * (factor - 1)`` per step instead, and the output says which.

In the rank (``train.py``): :func:`add_args` adds the flags, :class:`Slowdown` applies
them: ``ready()`` before training (waits until the benchmark has moved the process into
its cgroup), ``after_compute(seconds)`` after each step's compute.
"""
from __future__ import annotations

import math
import os
import random
import threading
import time
import uuid

MODES = ("jitter", "slow-rank")
JITTER_SIGMA = 0.3
SLOW_FACTOR = 1.5
CFS_PERIOD_US = 10_000
SLOW_RANK = 1  # rank 0 writes the metrics; the slow one is its peer


def wait_for_ranks(all_reduce) -> float:
    """Seconds this rank waits for the others to arrive, by one 1-element all-reduce.

    Validation starts with it: a validation is collective, so a rank that arrives first
    waits there for the others. That wait is idle time caused by uneven ranks, and the
    loops count it as training time and as waiting, not as validation.
    """
    import torch

    t = time.perf_counter()
    all_reduce(torch.zeros(1))
    return time.perf_counter() - t


def split_profile(name: str) -> tuple[str, str | None]:
    """``"100mbit+slow-rank"`` -> ``("100mbit", "slow-rank")``; ``"loopback"`` ->
    ``("loopback", None)``.

    Modes combine: ``"loopback+jitter+slow-rank"`` -> ``("loopback", "jitter+slow-rank")``.

    >>> split_profile("loopback+jitter"), split_profile("1gbit")
    (('loopback', 'jitter'), ('1gbit', None))
    """
    base, _, mode = name.partition("+")
    for m in mode.split("+") if mode else []:
        if m not in MODES:
            raise ValueError(f"unknown uneven mode {m!r} in profile {name!r}; choose from {MODES}")
    return base, mode or None


def has(mode: str | None, which: str) -> bool:
    """Whether ``mode`` (``split_profile``'s, e.g. ``"jitter+slow-rank"``) includes ``which``."""
    return bool(mode) and which in mode.split("+")


# ------------------------------------------------------------------ in the rank

def add_args(p) -> None:
    p.add_argument("--jitter-sigma", type=float, default=0.0,
                   help="uneven workers: sleep after each step's compute so that the step takes "
                        "compute * max(1, exp(sigma z)), z ~ N(0,1) seeded per rank")
    p.add_argument("--slow-rank", type=int, default=None,
                   help="uneven workers: this rank is slowed")
    p.add_argument("--slow-factor", type=float, default=SLOW_FACTOR)
    p.add_argument("--slow-cgroup", default=None,
                   help="slow-rank: the benchmark puts the rank into this cgroup (its CPU quota); "
                        "without it the rank sleeps compute * (factor - 1) per step")
    p.add_argument("--slow-cgroup-wait", type=float, default=30.0,
                   help="seconds to wait for the move into --slow-cgroup before falling back "
                        "to sleeps")


class Slowdown:
    """What one rank does for ``--jitter-sigma`` / ``--slow-rank`` (nothing by default)."""

    def __init__(self, args, rank: int) -> None:
        self.sigma = float(getattr(args, "jitter_sigma", 0.0) or 0.0)
        self.rng = random.Random(10_007 * (int(getattr(args, "seed", 0)) + 1) + rank)
        slow = getattr(args, "slow_rank", None)
        self.slow = slow is not None and slow == rank
        self.factor = float(getattr(args, "slow_factor", SLOW_FACTOR))
        self.cgroup = getattr(args, "slow_cgroup", None)
        self.wait_s = float(getattr(args, "slow_cgroup_wait", 30.0))
        self.method = None  # slow rank: "cgroup v1 ..." / "cgroup v2 ..." / "sleep"
        self.sleep_s = 0.0
        self.rank = rank

    @property
    def active(self) -> bool:
        return self.sigma > 0 or self.slow

    def ready(self) -> None:
        """Slow rank with a cgroup: wait until this process is in it (else: sleeps)."""
        if not self.slow:
            return
        if self.cgroup:
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline:
                where = in_cgroup(self.cgroup)
                if where:
                    self.method = f"cpu quota ({where})"
                    return
                time.sleep(0.02)
        self.method = "sleep"

    def after_compute(self, compute_s: float) -> float:
        """Sleep as the mode says after a step whose compute took ``compute_s``; returns the
        sleep."""
        extra = 0.0
        if self.sigma > 0:
            f = math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
            extra += compute_s * (max(1.0, f) - 1.0)
        if self.slow and self.method == "sleep":
            extra += compute_s * (self.factor - 1.0)
        if extra > 0:
            time.sleep(extra)
            self.sleep_s += extra
        return extra

    def describe(self) -> dict | None:
        if not self.active:
            return None
        return dict(jitter_sigma=self.sigma or None,
                    jitter="sleep after compute" if self.sigma > 0 else None,
                    slow_rank=self.rank if self.slow else None,
                    slow_factor=self.factor if self.slow else None, slow_method=self.method)


def in_cgroup(name: str) -> str | None:
    """``"v1"`` / ``"v2"`` if this process is in a cgroup whose path ends with ``/name``."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if path.rstrip("/").endswith("/" + name):
            if hid == "0":
                return "v2"
            if "cpu" in ctrls.split(","):
                return "v1"
    return None


# ------------------------------------------------------------- in the benchmark

def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_root() -> str | None:
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        ctl = os.path.join(root, "cgroup.controllers")
        if os.path.exists(ctl):
            with open(ctl) as f:
                if "cpu" in f.read().split():
                    return root
    return None


class CpuQuota:
    """A cgroup with a CPU quota of ``period / factor``; moves matching processes into it.

    ``with CpuQuota(1.5) as q: ...`` creates it (v2 ``cpu.max``, else v1 ``cpu.cfs_*``);
    a watcher thread moves every process whose command line contains ``q.tag`` and whose
    environment has ``RANK=<rank>`` into it. On exit: pids moved back to the root,
    the cgroup removed. ``q.method`` says what was used; ``q.error`` why none was (then
    the ranks fall back to sleeps). Needs root.
    """

    def __init__(self, factor: float = SLOW_FACTOR, rank: int = SLOW_RANK,
                 period_us: int = CFS_PERIOD_US) -> None:
        self.factor, self.rank, self.period_us = factor, rank, period_us
        self.quota_us = max(1000, int(round(period_us / factor)))
        self.tag = "dah_slow_" + uuid.uuid4().hex[:8]
        self.path = self.root = self.method = self.error = None
        self.moved: list[int] = []
        self.stat: dict = {}
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "CpuQuota":
        try:
            self._create()
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self._remove()
            self.path = None
        if self.path:
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.stat = self._read_stat()
        self._remove()

    def _read_stat(self) -> dict:
        """The cgroup's ``cpu.stat`` (throttled periods and time), before it is removed."""
        try:
            with open(os.path.join(self.path, "cpu.stat")) as f:
                return {k: int(v) for k, v in (line.split() for line in f if line.strip())}
        except (OSError, TypeError, ValueError):
            return {}

    def _create(self) -> None:
        v2 = _v2_root()
        if v2 is not None:
            try:
                _write(os.path.join(v2, "cgroup.subtree_control"), "+cpu")
            except OSError:
                pass
            self.root, self.path = v2, os.path.join(v2, self.tag)
            os.mkdir(self.path)
            try:
                _write(os.path.join(self.path, "cpu.max"), f"{self.quota_us} {self.period_us}")
                self.method = f"cgroup v2 cpu.max {self.quota_us} {self.period_us}"
                return
            except OSError:
                os.rmdir(self.path)
                self.path = None
        v1 = "/sys/fs/cgroup/cpu"
        if not os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            raise FileNotFoundError("no cgroup v2 cpu controller and no cgroup v1 cpu hierarchy")
        self.root, self.path = v1, os.path.join(v1, self.tag)
        os.mkdir(self.path)
        _write(os.path.join(self.path, "cpu.cfs_period_us"), str(self.period_us))
        _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(self.quota_us))
        self.method = (f"cgroup v1 cpu.cfs_quota_us {self.quota_us} / cpu.cfs_period_us "
                       f"{self.period_us}")

    def describe(self) -> str:
        if self.path is None:
            return f"sleep (no cgroup CPU quota: {self.error})"
        s = f"{self.method} ({self.quota_us / self.period_us:.3f} CPU)"
        if not self.moved:
            return s + ", but no process was moved into it (the rank fell back to sleeps)"
        thr = self.stat.get("nr_throttled")
        t = self.stat.get("throttled_time", self.stat.get("throttled_usec", 0) * 1000)
        if thr is not None:
            s += (f", throttled in {thr} of {self.stat.get('nr_periods', 0)} periods "
                  f"({t / 1e9:.1f} s)")
        return s

    def _watch(self) -> None:
        want = f"RANK={self.rank}".encode()
        while not self._stop.is_set():
            for pid in self._matching(want):
                try:
                    _write(os.path.join(self.path, "cgroup.procs"), str(pid))
                    self.moved.append(pid)
                except OSError:
                    pass
            self._stop.wait(0.5 if self.moved else 0.02)  # found: only a restart would add one

    def _matching(self, want: bytes) -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) in self.moved:
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
                if self.tag.encode() not in cmd or b"train.py" not in cmd:
                    continue
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if want in env:
                out.append(int(d))
        return out

    def _remove(self) -> None:
        if not self.path or not os.path.isdir(self.path):
            return
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = f.read().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                _write(os.path.join(self.root, "cgroup.procs"), pid)
            except OSError:
                pass
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def train_args(mode: str | None, quota: CpuQuota | None = None) -> list[str]:
    """The ``train.py`` flags of ``mode`` (``quota``: the slow rank's cgroup, if any)."""
    args = []
    if has(mode, "jitter"):
        args += ["--jitter-sigma", str(JITTER_SIGMA)]
    if has(mode, "slow-rank"):
        args += ["--slow-rank", str(SLOW_RANK), "--slow-factor", str(SLOW_FACTOR)]
        if quota is not None and quota.path is not None:
            args += ["--slow-cgroup", quota.tag]
    return args


# ------------------------------------------------------------------- reporting

def rows(runs: dict[str, dict]) -> list[dict]:
    """Per variant: mean step and compute time over the ranks, each rank's idle share.

    compute = step time minus time waiting on communication (gradient-sync waits and
    averaging rounds); overhead = (mean step - mean compute) / mean compute.

    >>> s = dict(per_rank_train_s=[10.0, 10.0], per_rank_comm_s=[3.0, 1.0],
    ...          per_rank_steps=[100, 60])
    >>> r = rows({"x": {"summary": s}})[0]
    >>> r["steps_per_rank"], round(r["mean_step_ms"], 1), round(r["mean_compute_ms"], 1)
    ('100/60', 133.3, 110.0)
    >>> r["idle_per_rank"], round(r["compute_overhead"], 3)
    ('30%/10%', 0.212)
    """
    out = []
    for name, run in runs.items():
        s = run["summary"]
        tr, cm, st = s.get("per_rank_train_s"), s.get("per_rank_comm_s"), s.get("per_rank_steps")
        if not (tr and cm and st):
            continue
        step = [t / max(n, 1) for t, n in zip(tr, st)]
        comp = [(t - c) / max(n, 1) for t, c, n in zip(tr, cm, st)]
        ms, mc = sum(step) / len(step), sum(comp) / len(comp)
        un = s.get("uneven") or {}
        out.append(dict(variant=name, steps_per_rank="/".join(str(int(n)) for n in st),
                        fast_over_slow=max(st) / max(min(st), 1),
                        mean_step_ms=ms * 1e3, mean_compute_ms=mc * 1e3,
                        idle_per_rank="/".join(f"{c / max(t, 1e-12):.0%}" for t, c in zip(tr, cm)),
                        compute_overhead=(ms - mc) / mc if mc > 0 else None,
                        rounds=(s.get("handle_stats") or {}).get("rounds"),
                        slowdown=un.get("slow_method") or un.get("jitter")))
    return out


COLUMNS = [("variant", "variant", "s"), ("steps per rank", "steps_per_rank", "s"),
           ("max/min steps", "fast_over_slow", ".2f"), ("rounds", "rounds", "d"),
           ("mean step ms", "mean_step_ms", ".1f"), ("mean compute ms", "mean_compute_ms", ".1f"),
           ("compute-variation overhead", "compute_overhead", ".1%"),
           ("idle share per rank", "idle_per_rank", "s")]
