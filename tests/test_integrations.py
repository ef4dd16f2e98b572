"""The framework integrations with the real packages: each example and its checks run in
one torchrun subprocess (2 CPU ranks, gloo), which prints a ``check <name>: ok`` line per
check (the checks themselves are in tests/_<framework>_checks.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMP_NUM_THREADS="1", DDP_AVG_HOOKS_DISABLE_EXT="1",
           TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _torchrun(script: str, *args: str, timeout: float = 150) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, script), *args]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{script} exited with {r.returncode}:\n{out[-6000:]}"
    return r.stdout


def _checks(out: str) -> dict[str, str]:
    return dict(re.findall(r"^check (\w+): (\w+)", out, flags=re.M))


def _assert_checks(out: str, names: list[str]) -> None:
    got = _checks(out)
    assert got == dict.fromkeys(names, "ok"), out


def test_importing_the_package_imports_no_framework():
    code = ("import sys, ddp_avg_hooks.integrations; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', "
            "'accelerate') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_each_integration_example_answers_help_with_its_command():
    for package in ("lightning", "transformers", "accelerate"):
        pytest.importorskip(package)
    folder = os.path.join(HERE, os.pardir, "examples", "integrations")
    names = ["accelerate_local_sgd.py", "hf_trainer_local_sgd.py", "lightning_local_sgd.py"]
    code = ("import runpy, sys\n"  # one interpreter: the frameworks imported once
            f"sys.path.insert(0, {folder!r})\n"
            f"for name in {names!r}:\n"
            f"    sys.argv = [name, '--help']\n"
            "    try:\n"
            f"        runpy.run_path({folder!r} + '/' + name, run_name='__main__')\n"
            "    except SystemExit as exc:\n"
            "        print('exit', exc.code)\n")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    for name in names:  # argparse's help, with the torchrun command of the docstring
        assert f"usage: {name} [-h]" in r.stdout, r.stdout
        assert f"torchrun --nproc-per-node 2 examples/integrations/{name}" in r.stdout, r.stdout
    assert r.stdout.count("exit 0") == 3, r.stdout


def _run_checks(script: str, packages: list[str], summary: str, agree: str, checks: list[str],
                *args: str) -> None:
    """Run a check script on 2 ranks: its summary line, its agreement line, every check ok."""
    for package in packages:
        pytest.importorskip(package)
    out = _torchrun(script, *args)
    assert re.search(summary, out), out
    assert agree in out, out
    _assert_checks(out, checks)


@pytest.mark.slow
def test_lightning(tmp_path):
    _run_checks("_lightning_checks.py", ["lightning"],
                r"lightning: 41 steps, 6 rounds .*replicas differ by 0\.0e\+00",
                "lightning: replicas agree", [
                    # bit-identical to DDPStrategy's post-local SGD
                    "parity_post_local_sgd",
                    "replicas_apart_after_local_step",
                    "reducer_off_after_warmup",
                    "parity_lightning_cpu_grad_sync",  # and to DDPStrategy as it runs on CPU
                    "cpu_differs_from_local_sgd",
                    "fp16_hook_replicas_agree",
                    "accumulation_rounds_at_optimizer_steps",
                    "state_dict_on_every_rank",
                    "checkpoint_has_each_ranks_state",
                    "resume_matches_uninterrupted",
                    "resume_with_another_hook_raises",
                    "resume_without_the_callbacks_state_raises",
                ], str(tmp_path))


@pytest.mark.slow
def test_accelerate():
    _run_checks("_accelerate_checks.py", ["accelerate"],
                r"accelerate: 64 micro-batches, 32 optimizer steps, 4 rounds \+ 1 on leaving",
                "accelerate: replicas agree",
                ["parity_accelerate_local_sgd", "replicas_agree_on_exit",
                 "reducer_off_after_warmup", "block_0_rounds_and_agree",
                 "block_1_rounds_and_agree", "uneven_inputs_join", "disabled_is_noop"])


@pytest.mark.slow
def test_hf_trainer():
    _run_checks("_hf_checks.py", ["transformers", "accelerate"],
                r"hf trainer: DistributedDataParallel over 2 processes, 21 steps, 6 rounds",
                "hf trainer: replicas agree",
                ["rounds_at_optimizer_steps", "gradients_local_after_warmup",
                 "removed_at_train_end", "reducer_off_after_warmup"])
