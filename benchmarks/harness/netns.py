"""Network profiles for the benchmark harness: real links, not simulated ones.

A shaped profile puts each of two "nodes" in its own network namespace, joined by one
veth pair, and shapes both ends with ``tc ... tbf`` (token bucket: rate limit). Delay
would need ``netem``; when the kernel lacks it (``Specified qdisc kind is unknown``) the
profile says so in :attr:`NetnsPair.notes` and runs without delay.

Each namespace gets an ``/etc/netns/<name>/hosts`` (``ip netns exec`` mounts it over
``/etc/hosts``) naming localhost and both nodes, so that looking up a peer's address
answers locally; DNS is out of reach in there, and c10d's reverse lookup of each client
socket would otherwise fail (``The hostname of the client socket cannot be retrieved``).

Everything created is torn down on exit, even on failure: the context manager's
``finally``, an ``atexit`` hook and SIGTERM / SIGINT / SIGHUP handlers all call
:func:`teardown_all`. Names carry the creating PID (``dah<pid>a``), so
:func:`cleanup_stale` can remove leftovers of a process that was SIGKILLed (namespaces
and their ``/etc/netns`` folders).

Traffic stays inside the namespaces: the veth pair is the only link in them besides
their own loopback, and no route leads out.

Example (needs root and ``ip``; the doctest only checks the profile table)::

    >>> sorted(PROFILES)
    ['100mbit', '1gbit', '25mbit', 'loopback']
    >>> PROFILES['100mbit'].rate_mbit
    100
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading

__all__ = ["Profile", "PROFILES", "NetnsPair", "netns_available", "teardown_all",
           "cleanup_stale", "measure_throughput"]

PREFIX = "dah"
ETC_NETNS = "/etc/netns"


@dataclasses.dataclass(frozen=True)
class Profile:
    """A network profile: ``rate_mbit=None`` means unshaped local loopback."""
    name: str
    rate_mbit: int | None = None
    delay_ms: float = 0.0

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None


PROFILES = {
    "loopback": Profile("loopback"),
    "1gbit": Profile("1gbit", rate_mbit=1000),
    "100mbit": Profile("100mbit", rate_mbit=100),
    "25mbit": Profile("25mbit", rate_mbit=25),
}


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_available() -> tuple[bool, str]:
    """Whether namespaces can be made here; the reason when not."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (running as uid %d)" % os.geteuid()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, "root and `ip netns` available"


# ---- teardown registry: every created namespace until it is deleted ----------------
_live: set[str] = set()
_lock = threading.Lock()
_handlers_installed = False


def teardown_all() -> None:
    """Delete every namespace this process created and has not deleted yet."""
    with _lock:
        names = sorted(_live)
        _live.clear()
    for ns in names:
        _delete_ns(ns)


def _delete_ns(ns: str) -> None:
    """Kill what runs in ``ns``, delete it, and remove its ``/etc/netns/<ns>`` files."""
    _kill_ns_processes(ns)
    _run(["ip", "netns", "del", ns], check=False)
    remove_etc(ns)


def etc_dir(ns: str) -> str:
    """``ip netns exec ns`` bind-mounts each file in this folder over the one in ``/etc``."""
    return os.path.join(ETC_NETNS, ns)


def remove_etc(ns: str) -> None:
    d = etc_dir(ns)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(d, "hosts"))
    with contextlib.suppress(OSError):  # not there, or holds files someone else put there
        os.rmdir(d)


def hosts_text(nodes: list[tuple[str, str]]) -> str:
    """An ``/etc/hosts`` for a namespace: localhost (and this machine's name), then the nodes.

    The nodes' entries let a reverse lookup of a peer's address (c10d does one for each
    client socket) answer from the file instead of asking DNS, which cannot be reached
    from inside a namespace.

    >>> print(hosts_text([("10.0.0.1", "n1"), ("10.0.0.2", "n2")]), end="")  # doctest: +ELLIPSIS
    127.0.0.1 localhost...
    ::1 localhost ip6-localhost ip6-loopback
    10.0.0.1 n1
    10.0.0.2 n2
    ::ffff:127.0.0.1 localhost...
    ::ffff:10.0.0.1 n1
    ::ffff:10.0.0.2 n2
    """
    me = socket.gethostname()
    local = "localhost" + (" " + me if me and me != "localhost" else "")
    lines = [f"127.0.0.1 {local}", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{addr} {name}" for addr, name in nodes]
    # a dual-stack listener (c10d's TCPStore) sees IPv4 peers as IPv4-mapped IPv6 addresses,
    # which the resolver looks up as such: name those too
    lines += [f"::ffff:127.0.0.1 {local}"] + [f"::ffff:{addr} {name}" for addr, name in nodes]
    return "\n".join(lines) + "\n"


def _kill_ns_processes(ns: str) -> None:
    r = _run(["ip", "netns", "pids", ns], check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _on_signal(signum, frame):
    teardown_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the same signal, as if we had not caught it


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    atexit.register(teardown_all)
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler, None):
                signal.signal(s, _on_signal)
    _handlers_installed = True


def cleanup_stale() -> list[str]:
    """Delete ``dah<pid>*`` namespaces whose creating process is gone; returns their names."""
    r = _run(["ip", "netns", "list"], check=False)
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(PREFIX + r"(\d+)[a-z]+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete_ns(name)
            removed.append(name)
    with contextlib.suppress(OSError):  # hosts files left without their namespace
        for name in os.listdir(ETC_NETNS):
            m = re.fullmatch(PREFIX + r"(\d+)[a-z]+", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}") and name not in removed:
                remove_etc(name)
    return removed


class NetnsPair:
    """Two namespaces ``a`` and ``b`` joined by a veth pair, shaped to ``profile``.

    Attributes: ``ns`` (names, also the nodes' host names in each namespace's hosts
    file), ``ifname`` (veth device in each), ``addr`` (IPv4 of each),
    ``notes`` (what the profile could not apply, e.g. delay without netem).
    Use as a context manager; ``exec_prefix(i)`` gives the argv prefix that runs a command
    in namespace ``i``.
    """

    SUBNET = "10.231.0"

    def __init__(self, profile: Profile, tag: str = "") -> None:
        if not profile.shaped and profile.delay_ms == 0:
            pass  # an unshaped pair is still useful (2 real nodes, full veth speed)
        self.profile = profile
        base = f"{PREFIX}{os.getpid()}{tag}"
        self.ns = (base + "a", base + "b")
        pid = os.getpid() % 100000
        self.ifname = (f"dah{pid}a", f"dah{pid}b")
        self.addr = (f"{self.SUBNET}.1", f"{self.SUBNET}.2")
        self.notes: list[str] = []
        self._up = False

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "NetnsPair":
        self.setup()
        return self

    def __exit__(self, *exc) -> bool:
        self.teardown()
        return False

    def setup(self) -> None:
        _install_handlers()
        try:
            for ns in self.ns:
                _run(["ip", "netns", "add", ns])
                with _lock:
                    _live.add(ns)
            self._write_hosts()
            a, b = self.ifname
            _run(["ip", "link", "add", a, "netns", self.ns[0], "type", "veth",
                  "peer", "name", b, "netns", self.ns[1]])
            for i in (0, 1):
                n = ["ip", "-n", self.ns[i]]
                _run(n + ["link", "set", "lo", "up"])
                _run(n + ["addr", "add", f"{self.addr[i]}/24", "dev", self.ifname[i]])
                _run(n + ["link", "set", self.ifname[i], "up"])
                self._shape(i)
            self._up = True
        except BaseException:
            self.teardown()
            raise

    def _write_hosts(self) -> None:
        text = hosts_text(list(zip(self.addr, self.ns)))
        for ns in self.ns:
            os.makedirs(etc_dir(ns), exist_ok=True)
            with open(os.path.join(etc_dir(ns), "hosts"), "w") as f:
                f.write(text)

    def _shape(self, i: int) -> None:
        p, ns, dev = self.profile, self.ns[i], self.ifname[i]
        if p.delay_ms:
            r = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                      "netem", "delay", f"{p.delay_ms}ms"], check=False)
            if r.returncode != 0:
                note = f"delay {p.delay_ms} ms not applied: netem unavailable ({r.stderr.strip()})"
                if note not in self.notes:
                    self.notes.append(note)
                parent = ["root"]
            else:
                parent = ["parent", "1:1", "handle", "10:"]
        else:
            parent = ["root"]
        if p.rate_mbit is not None:
            rate_bps = p.rate_mbit * 1_000_000
            # burst: >= 5 ms of traffic and >= one 64 KiB GSO segment; latency bounds the queue
            burst = max(rate_bps // 8 // 200, 128 * 1024)
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf",
                  "rate", f"{p.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"])

    def teardown(self) -> None:
        for ns in self.ns:
            with _lock:
                owned = ns in _live
                _live.discard(ns)
            if owned:
                _delete_ns(ns)
        self._up = False

    # -- use -------------------------------------------------------------------------
    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def describe(self) -> str:
        p = self.profile
        rate = f"{p.rate_mbit} Mbit/s (tc tbf)" if p.rate_mbit else "unshaped"
        s = f"2 network namespaces joined by a veth pair, {rate}"
        return s + ("; " + "; ".join(self.notes) if self.notes else "")

    def wire_bytes(self, i: int) -> int:
        """Bytes sent so far by namespace ``i``'s veth device (kernel counter)."""
        r = _run(["ip", "-n", self.ns[i], "-s", "-j", "link", "show", self.ifname[i]])
        import json
        return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


def existing_namespaces() -> set[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in r.stdout.splitlines() if line.split()}


# ---- throughput probe (used by tests and to report the measured link) ---------------
_SINK = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
s.settimeout(30); c, _ = s.accept(); c.settimeout(30); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b"k"); print(n, flush=True)
"""

_SOURCE = r"""
import socket, sys, time
n = int(sys.argv[3]); s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
buf = b"x" * (1 << 16); t = time.perf_counter(); sent = 0
while sent < n:
    s.sendall(buf); sent += len(buf)
s.shutdown(socket.SHUT_WR); s.recv(1); print(sent / (time.perf_counter() - t), flush=True)
"""


def measure_throughput(pair: NetnsPair, nbytes: int = 4 << 20, port: int = 5201) -> float:
    """Send ``nbytes`` from namespace a to b over TCP; returns bytes per second."""
    sink = subprocess.Popen(pair.exec_prefix(1) + [sys.executable, "-c", _SINK, pair.addr[1],
                                                   str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("throughput sink did not start")
        r = subprocess.run(pair.exec_prefix(0) + [sys.executable, "-c", _SOURCE, pair.addr[1],
                                                  str(port), str(nbytes)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"throughput source failed: {r.stderr.strip()}")
        return float(r.stdout.strip())
    finally:
        sink.kill()
        sink.wait()


# PYTHONPATH=benchmarks python -m harness.netns [profile]: measure a link
if __name__ == "__main__":
    ok, why = netns_available()
    print(why)
    if ok:
        for name in sys.argv[1:] or ["100mbit", "1gbit"]:
            with NetnsPair(PROFILES[name]) as pair:
                bps = measure_throughput(pair, 16 << 20)
                print(f"{name}: {pair.describe()}: measured {bps * 8 / 1e6:.0f} Mbit/s")
