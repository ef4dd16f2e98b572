"""The suite's per-test deadline (the repository's conftest.py): a test that hangs fails
alone, with its stacks in the summary, and the tests after it still run."""

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFTEST = os.path.join(os.path.dirname(HERE), "conftest.py")

HANGING = '''
import threading, time

def test_before():
    pass

def test_blocked_in_a_wait_that_never_ends():
    threading.Event().wait()

def test_after():
    pass
'''


def test_a_hung_test_fails_with_its_stacks_and_the_rest_still_run(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_hangs.py").write_text(HANGING)
    env = {k: v for k, v in os.environ.items() if k != "DAH_TEST_DUMP_DIR"}
    env["DAH_TEST_DEADLINE"] = "2"
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider",
                        "-o", "addopts=", "test_hangs.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "tests past their deadline" in out, out
    hung = "test_hangs.py::test_blocked_in_a_wait_that_never_ends"
    assert f"{hung} was still running after 2 s" in out, out
    assert "in test_blocked_in_a_wait_that_never_ends" in out, out  # its stack
