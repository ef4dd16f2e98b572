"""The user examples in examples/ run as their docstrings say: torchrun, CPU, gloo."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")


def _torchrun(script: str, nproc: int, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", DDP_AVG_HOOKS_DISABLE_EXT="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), os.path.join(EXAMPLES, script), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (f"{script} exited with {r.returncode}:\n"
                               f"{r.stdout}\n{r.stderr[-4000:]}")
    return r.stdout


def _losses(out: str) -> tuple[float, float]:
    before = float(re.search(r"validation loss before training: ([\d.]+)", out).group(1))
    after = float(re.search(r"validation loss after \d+ steps: ([\d.]+)", out).group(1))
    return before, after


# with the examples' defaults: what each must print about its rounds and bytes
EXPECT = {
    # warm-up 10, period 8: rounds at steps 11, 19, ..., 59, plus handle.average() at the end
    "local_sgd.py": r"10 warm-up gradient all-reduces \+ 8 averaging rounds .*\(([\d.]+)x more\)",
    # period 16: rounds at steps 1, 17, 33, 49, 65; fp16 halves each round's bytes
    "diloco.py": r"in 5 rounds \(fp16\); DDP would send .*\(([\d.]+)x more\)",
    # node rounds at steps 1, 3, ..., 33; global rounds at 1, 9, 17, 25, 33
    "hierarchical.py": r"4 ranks as 2 nodes of 2(?s:.*)node rounds: 17, .* global rounds: 5,",
}


@pytest.mark.parametrize("script,nproc,args", [
    ("local_sgd.py", 2, ()),
    ("diloco.py", 2, ()),
    ("hierarchical.py", 4, ("--ranks-per-node", "2")),
])
@pytest.mark.slow
def test_example_trains_and_replicas_agree(script, nproc, args):
    out = _torchrun(script, nproc, *args)
    assert "replicas agreed after every round" in out, out
    before, after = _losses(out)
    assert after < 0.5 * before, out
    m = re.search(EXPECT[script], out)
    assert m, out
    if m.groups():  # fewer bytes than DDP's gradient all-reduce at every step
        assert float(m.group(1)) > 2, out


@pytest.mark.slow
def test_local_sgd_example_with_uneven_inputs():
    """Rank 1 has 20 batches fewer: inside Join it still takes part in every round, and
    both ranks end with the same model, as trained as the even run's."""
    out = _torchrun("local_sgd.py", 2, "--uneven", "20")
    assert "1 of 2 ranks ran out of batches early; every rank took part in all 7 rounds " \
        "(66 steps)" in out, out
    assert "replicas agreed at the end" in out, out
    before, after = _losses(out)
    assert after < 0.5 * before, out
