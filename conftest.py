"""What every test of the suite gets: a deadline, and no process group left behind (a
doctest that starts one in the pytest process ends it).

Every test has a deadline (``DAH_TEST_DEADLINE`` seconds, 300 by default, ten times the
longest test's time on 2 cores): a test still running then has every thread's Python
stack written out and its pytest process ended, so a hang (a collective or a child
process that never returns) fails that one test, with the stacks in the run's summary,
instead of stalling the whole suite. The stacks are written by ``faulthandler``'s own
thread, so a test blocked inside C++ with the GIL released is caught too. (Without
pytest-xdist the ended process is pytest itself: the stacks stay in the file
``$DAH_TEST_DUMP_DIR/<pid>.txt``.)
"""

import faulthandler
import os
import shutil
import tempfile

import pytest
import torch.distributed as dist

TEST_DEADLINE_S = float(os.environ.get("DAH_TEST_DEADLINE", "300"))
_DUMPS = "DAH_TEST_DUMP_DIR"


def pytest_configure(config):
    # made before pytest-xdist starts its workers, which inherit the variable
    if _DUMPS not in os.environ:
        os.environ[_DUMPS] = config._dah_dumps = tempfile.mkdtemp(prefix="dah_test_deadline_")


def pytest_unconfigure(config):
    folder = getattr(config, "_dah_dumps", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[_DUMPS]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.path.join(os.environ[_DUMPS], f"{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(f"{item.nodeid} was still running after {TEST_DEADLINE_S:g} s "
                f"(DAH_TEST_DEADLINE); the stacks of its process's threads:\n")
        f.flush()
        faulthandler.dump_traceback_later(TEST_DEADLINE_S, exit=True, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    os.remove(path)


def pytest_terminal_summary(terminalreporter):
    """Show the stacks of any test that ran past its deadline (in a worker that was ended)."""
    folder = os.environ.get(_DUMPS)
    names = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            text = f.read()
        if "Timeout (" in text:  # faulthandler's line: the deadline passed
            terminalreporter.section("tests past their deadline", sep="=", red=True)
            terminalreporter.write(text)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# The framework integrations stay out of doctest collection: importing Lightning or
# Transformers takes seconds in every worker, and tests/test_integrations.py runs them
# (in subprocesses, with the real packages) anyway.
collect_ignore = [
    "ddp_avg_hooks/integrations/lightning.py",
    "ddp_avg_hooks/integrations/accelerate.py",
    "ddp_avg_hooks/integrations/transformers.py",
]


def pytest_collection_modifyitems(items):
    """Tests marked ``slow`` (multi-process runs of several seconds) first, the rest in
    collection order: ``make test`` hands tests to its workers one at a time in this order
    (``--dist loadgroup --no-loadscope-reorder``), so no worker is left with a long test
    at the end while the other idles. A module whose tests share a module-scoped run is
    one ``xdist_group``, run by one worker."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
