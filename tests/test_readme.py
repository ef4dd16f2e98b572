"""The README's code runs as printed: the torchrun example and the hook snippets."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah

# a rank's "loss 0.071" (the example prints three decimals): found even where the two
# ranks' prints interleave piece by piece, and nan or inf where one diverged
_LOSS = r"loss (nan|-?inf|-?\d+\.\d{3})"

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_training_example_runs_under_torchrun(tmp_path):
    program = tmp_path / "train.py"
    program.write_text(_python_blocks()[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", DDP_AVG_HOOKS_DISABLE_EXT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(program)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one line per rank (their output may interleave): 200 steps, warm-up 20, period 8
    stats = re.findall(r"AveragingStats\(rounds=(\d+)", proc.stdout)
    assert stats == ["23", "23"], proc.stdout
    # and it trains: the loss of a first step is about 30 (the target's variance is 32)
    losses = [float(v) for v in re.findall(_LOSS, proc.stdout)]
    assert len(losses) == 2 and all(0.0 <= v < 2.0 for v in losses), proc.stdout


def test_readme_hook_snippets_register_and_average(world1):
    mean_block, delta_block = _python_blocks()[1:3]
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(6, 3))
    namespace = {"dah": dah, "dist": dist, "torch": torch, "ddp": ddp}
    exec(mean_block, namespace)
    before = [p.detach().clone() for p in ddp.parameters()]
    namespace["handle"].average()  # one rank: the mean is the parameters themselves
    assert all(torch.equal(p.detach(), b) for p, b in zip(ddp.parameters(), before))
    assert namespace["handle"].stats.bytes_sent == 4 * sum(b.numel() for b in before)
    namespace["handle"].remove()

    class MyState:
        pass

    namespace["MyState"] = MyState
    exec(delta_block, namespace)
    hook = namespace["my_delta_hook"]
    assert dah.hook_spec(hook).needs_anchor
    handle = dah.register_averaging_hook(ddp, hook, MyState(), period=2)
    with torch.no_grad():
        for p in ddp.parameters():
            p.add_(0.25)
    expected = [p.detach().clone() for p in ddp.parameters()]
    assert handle.step()  # the delta 0.25 is exact in fp16
    assert all(torch.equal(p.detach(), e) for p, e in zip(ddp.parameters(), expected))
    assert handle.stats.bytes_sent == 2 * sum(e.numel() for e in expected)
    try:
        dah.register_averaging_hook(ddp, hook, None)
    except TypeError as exc:
        assert "my_delta_hook: state must be a MyState" in str(exc)
    else:
        raise AssertionError("validate_state did not run")
