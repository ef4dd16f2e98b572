"""Each framework's own checkpoint, taken mid-period on 2 ranks and resumed in fresh
processes, continues bit-identically to an uninterrupted run (see ``_resume_checks.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PACKAGES = {"hf": "transformers", "accelerate": "accelerate", "accelerate_epochs": "accelerate",
            "lightning": "lightning"}


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["hf", "accelerate", "accelerate_epochs", "lightning"])
def test_a_mid_period_checkpoint_resumes_bit_identically(framework, tmp_path):
    pytest.importorskip(PACKAGES[framework])
    out = ""
    for phase in ("straight", "resume"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", os.path.join(HERE, "_resume_checks.py"), framework,
               phase, str(tmp_path)]
        r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, f"{framework} {phase}:\n{(r.stdout + r.stderr)[-6000:]}"
        out += r.stdout
    assert f"check {framework}_resume_is_bit_identical: ok" in out, out
    if framework == "accelerate_epochs":  # a LocalSGD per epoch, saved between two of them
        assert "check accelerate_epochs_registered_once: ok" in out, out
        assert "check accelerate_epochs_partial_state_refused_on_every_rank: ok" in out, out
        return
    assert f"check {framework}_replicas_resumed_their_own_state: ok" in out, out
    if framework == "hf":  # another run's averaging state beside the Trainer's files
        assert "check hf_foreign_state_refused_on_every_rank: ok" in out, out
