"""The launcher leaves no rank behind when it is itself stopped."""
import os
import signal
import subprocess
import sys
import time

import pytest

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

SLEEPER = '''
import os, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
with open(os.path.join(out, "pid_" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(300)
'''

LAUNCHER = '''
import sys
from harness import launch
launch.run_training([], sys.argv[1], script=sys.argv[2], timeout_s=300)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its parent's wait
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.torchrun
def test_a_launcher_stopped_by_sigterm_kills_its_ranks_first(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": BENCHMARKS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(out), str(script)], env=env)
    try:
        deadline = time.monotonic() + 120
        pids = []
        while len(pids) < 2:
            assert launcher.poll() is None, f"the launcher exited with {launcher.returncode}"
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.1)
            pids = [int(p.read_text()) for p in out.glob("pid_*") if p.read_text()]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "ranks outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        for p in out.glob("pid_*"):
            if p.read_text() and _alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)
