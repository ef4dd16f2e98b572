"""Network profiles: namespaces + veth + tc tbf are made, shape the link, and always go away."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from harness import netns

OK, WHY = netns.netns_available() if sys.platform == "linux" else (False, "not Linux")
pytestmark = pytest.mark.skipif(not OK, reason=f"needs root and ip netns: {WHY}")


def test_pair_is_shaped_and_torn_down():
    pair = netns.NetnsPair(netns.PROFILES["100mbit"], tag="t")
    with pair:
        assert set(pair.ns) <= netns.existing_namespaces()
        bps = netns.measure_throughput(pair, nbytes=2 << 20, port=5301)
        assert 10e6 / 8 < bps < 115e6 / 8, f"{bps * 8 / 1e6:.0f} Mbit/s on a 100 Mbit/s profile"
        assert pair.wire_bytes(0) >= 2 << 20
        # nothing leaves the namespace: its only routes are the veth subnet
        r = subprocess.run(pair.exec_prefix(0) + ["ip", "route"], capture_output=True, text=True)
        assert "default" not in r.stdout
    assert not set(pair.ns) & netns.existing_namespaces()
    assert not any(os.path.exists(netns.etc_dir(ns)) for ns in pair.ns)


def test_hosts_file_names_both_nodes():
    with netns.NetnsPair(netns.PROFILES["1gbit"], tag="h") as pair:
        for i in (0, 1):
            with open(os.path.join(netns.etc_dir(pair.ns[i]), "hosts")) as f:
                text = f.read()
            assert "localhost" in text
            for addr, name in zip(pair.addr, pair.ns):
                assert f"{addr} {name}" in text
            # inside the namespace, a reverse lookup of the peer answers from that file, for
            # its IPv4 address and for the IPv4-mapped IPv6 one a dual-stack listener sees
            peer = pair.addr[1 - i]
            code = ("import socket\n"
                    f"print(socket.getnameinfo(({peer!r}, 1), socket.NI_NAMEREQD)[0])\n"
                    f"print(socket.getnameinfo(('::ffff:' + {peer!r}, 1, 0, 0), "
                    "socket.NI_NAMEREQD)[0])")
            r = subprocess.run(pair.exec_prefix(i) + [sys.executable, "-c", code],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == [pair.ns[1 - i]] * 2
    assert not any(os.path.exists(netns.etc_dir(ns)) for ns in pair.ns)


def test_teardown_on_exception():
    pair = netns.NetnsPair(netns.PROFILES["1gbit"], tag="x")
    with pytest.raises(RuntimeError, match="boom"):
        with pair:
            raise RuntimeError("boom")
    assert not set(pair.ns) & netns.existing_namespaces()
    assert not any(os.path.exists(netns.etc_dir(ns)) for ns in pair.ns)


def test_teardown_when_setup_fails(monkeypatch):
    pair = netns.NetnsPair(netns.PROFILES["100mbit"], tag="f")

    def fail(i):
        assert os.path.exists(os.path.join(netns.etc_dir(pair.ns[i]), "hosts"))
        raise RuntimeError("shaping failed")
    monkeypatch.setattr(pair, "_shape", fail)
    with pytest.raises(RuntimeError, match="shaping failed"):
        pair.setup()
    assert not set(pair.ns) & netns.existing_namespaces()
    assert not any(os.path.exists(netns.etc_dir(ns)) for ns in pair.ns)


_CHILD = """
import signal, sys, time
# SIGINT as a process started from a shell has it: a test runner's worker may hand its
# children SIGINT ignored or blocked, and an ignored SIGINT gets no teardown handler
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from harness import netns
pair = netns.NetnsPair(netns.PROFILES["100mbit"]); pair.setup()
print(" ".join(pair.ns), flush=True)
sys.stdin.readline()
if sys.argv[1] == "exit":
    sys.exit(3)        # no teardown call: atexit must do it
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exit", "SIGTERM", "SIGINT", "SIGKILL"])
def test_teardown_when_the_process_dies(how):
    benchmarks = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [benchmarks, *filter(None, [os.environ.get("PYTHONPATH")])]))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, how], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        names = p.stdout.readline().split()
        assert len(names) == 2 and set(names) <= netns.existing_namespaces()
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(0.2)
        if how != "exit":
            p.send_signal(getattr(signal, how))
        p.wait(timeout=30)
        if how == "SIGKILL":  # nothing runs in a SIGKILLed process: the next user cleans up
            assert set(names) <= netns.existing_namespaces()
            assert all(os.path.exists(netns.etc_dir(ns)) for ns in names)
            assert set(names) <= set(netns.cleanup_stale())
        assert not set(names) & netns.existing_namespaces()
        assert not any(os.path.exists(netns.etc_dir(ns)) for ns in names)
    finally:
        if p.poll() is None:
            p.kill()
        netns.cleanup_stale()


def test_profiles_report_missing_delay():
    prof = netns.Profile("delayed", rate_mbit=100, delay_ms=5)
    with netns.NetnsPair(prof, tag="d") as pair:
        # this kernel may lack netem: then the note says delay was not applied, and the rate
        # still is
        if pair.notes:
            assert "not applied" in pair.notes[0]
            assert "not applied" in pair.describe()
