"""DiLoCo at period 32 against DDP, each at its own learning rate: the sweep behind its tuning.

Validation loss depends on the samples seen, not on the network, so this runs on loopback
(2 CPU ranks, the ~1M-parameter ``bench`` preset): DDP's AdamW learning rate over
{5e-4, 1e-3, 2e-3, 4e-3} for 800 steps, then DiLoCo (outer Nesterov SGD over exact
averaging, period 32) over its inner learning rate and outer (lr, momentum) for 1600 steps,
and plain period-32 averaging as the outer ``SGD(lr=1)`` special case. The target is the
lowest final loss of the DDP runs (DDP at its best learning rate); a run "reaches" it at
its first validation at or below it. Bytes are those rank 0 handed to collectives, so
"x fewer bytes" is DDP's bytes to the target over the run's.

Outputs ``benchmarks/results/diloco_sweep.json`` and the section "DiLoCo sweep"
of ``benchmarks/RESULTS.md``. About 25 minutes on 2 cores; ``--reuse`` keeps runs whose
``metrics.json`` already exists under ``--runs-dir``.

    python benchmarks/bench_diloco_sweep.py

``--sweep period8`` asks the same question at the slow-link benchmark's setting: period 8
and a 200-step horizon (DDP at its tuned lr 1e-3, the others up to 240 steps), where a
variant that beat DDP's loss per step could reach DDP's target sooner than DDP's step
count. It writes the section "Outer optimizer at period 8" and
``results/outer_period8_sweep.json`` (about 6 minutes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from harness import launch, report

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One sweep: its section, step budgets, checkpoints and runs (name -> train.py args)."""
    section: str
    json_name: str
    period: int
    ddp_steps: int
    steps: int
    checkpoints: tuple[int, ...]
    eval_every: int
    ddp_runs: dict
    other_runs: dict


def _outer(period: int, grid) -> dict:
    return {f"diloco_lr{lr}_outer{olr}_m{m}": ["--hook", "diloco", "--period", str(period),
                                               "--lr", lr, "--outer-lr", olr, "--outer-momentum", m]
            for lr, olr, m in grid}


def _averaging(period: int, lrs) -> dict:
    return {f"average_lr{lr}": ["--hook", "allreduce", "--period", str(period), "--lr", lr]
            for lr in lrs}


SWEEPS = {
    "diloco": Sweep(
        "## DiLoCo sweep", "diloco_sweep.json", 32, 800, 1600, (200, 400, 800, 1200, 1600), 40,
        {f"ddp_lr{lr}": ["--hook", "ddp", "--lr", lr] for lr in ("5e-4", "1e-3", "2e-3", "4e-3")},
        {**_averaging(32, ("2e-3", "1e-3")),
         **_outer(32, [("2e-3", "0.7", "0.9"), ("1e-3", "0.7", "0.9"), ("5e-4", "0.7", "0.9"),
                       ("3e-4", "0.7", "0.9"), ("2e-4", "0.7", "0.9"), ("3e-4", "0.5", "0.9"),
                       ("1e-3", "0.4", "0.9"), ("5e-4", "1.0", "0.9"), ("2e-3", "1.0", "0.5")])}),
    "period8": Sweep(
        "## Outer optimizer at period 8", "outer_period8_sweep.json", 8, 200, 240,
        (80, 160, 200, 240), 20,
        {"ddp_lr1e-3": ["--hook", "ddp", "--lr", "1e-3"]},
        {**_averaging(8, ("1e-3",)),
         **_outer(8, [("1e-3", "1.0", "0"), ("1e-3", "1.0", "0.2"), ("1e-3", "1.0", "0.5"),
                      ("1e-3", "1.0", "0.7"), ("1e-3", "0.7", "0.9"), ("1e-3", "1.5", "0"),
                      ("1e-3", "2.0", "0"), ("5e-4", "1.0", "0.5"), ("5e-4", "0.7", "0.9")])}),
}


def _run(name: str, args: list[str], steps: int, a) -> dict:
    out = os.path.join(a.runs_dir, name)
    metrics = os.path.join(out, "metrics.json")
    if a.reuse and os.path.exists(metrics):
        with open(metrics) as f:
            run = json.load(f)
        a.reused.append(name)
        return run
    common = ["--preset", "bench", "--steps", str(steps), "--eval-every", str(a.eval_every),
              "--progress", "off"]
    t0 = time.time()
    run = launch.run_training([*common, *args], out, timeout_s=a.timeout)
    print(f"{name}: final val {run['evals'][-1]['val_loss']:.3f} ({time.time() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    return run


def rows(runs: dict[str, dict], target: float, ddp_bytes: float, checkpoints) -> list[str]:
    """One markdown row per run: losses at the checkpoints, where it reached the target."""
    out = []
    for name, run in runs.items():
        cfg = run["config"]
        hit = next((e["step"] for e in run["evals"] if e["val_loss"] <= target), None)
        btt = report.bytes_to_target(run, target)
        losses = [report.loss_at_step(run, s) for s in checkpoints]
        outer = (f"{cfg['outer_lr']:g} / {cfg['outer_momentum']:g}" if cfg["hook"] == "diloco"
                 else "1 / 0 (plain averaging)" if cfg["hook"] == "allreduce" else "n/a")
        out.append(" | ".join([
            f"| {cfg['hook']}", f"{cfg['lr']:g}", outer,
            *("" if v is None else f"{v:.3f}" for v in losses),
            "no" if hit is None else str(hit),
            "n/a" if not btt else f"{btt / 1e6:.0f}",
            "n/a" if not btt else f"{ddp_bytes / btt:.1f}"]) + " |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", choices=sorted(SWEEPS), default="diloco")
    p.add_argument("--runs-dir", default=None, help="default: out/<sweep>_sweep")
    p.add_argument("--reuse", action="store_true", help="keep runs that already have metrics.json")
    p.add_argument("--eval-every", type=int, default=None, help="default: the sweep's")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"))
    a = p.parse_args(argv)
    sw = SWEEPS[a.sweep]
    a.runs_dir = a.runs_dir or os.path.join(HERE, os.pardir, "out", f"{a.sweep}_sweep")
    a.eval_every = a.eval_every or sw.eval_every
    a.reused = []
    t0 = time.time()
    ddp = {n: _run(n, args, sw.ddp_steps, a) for n, args in sw.ddp_runs.items()}
    best = min(ddp, key=lambda n: ddp[n]["evals"][-1]["val_loss"])
    target = ddp[best]["evals"][-1]["val_loss"]
    ddp_bytes = report.bytes_to_target(ddp[best], target)
    others = {n: _run(n, args, sw.steps, a) for n, args in sw.other_runs.items()}
    head = ["| variant | inner lr | outer lr / momentum | "
            + " | ".join(f"loss @ {s}" for s in sw.checkpoints)
            + " | reaches target at step | MB to target | x fewer bytes than DDP |",
            "|" + "---|" * (6 + len(sw.checkpoints))]
    cmd = "python benchmarks/bench_diloco_sweep.py" + "".join(
        f" {x}" for x in (argv or sys.argv[1:]))
    took = f"{(time.time() - t0) / 60:.1f} min" + (
        f"; {len(a.reused)} of {len(ddp) + len(others)} runs reused from --runs-dir, made by "
        "the same train.py arguments" if a.reused else "")
    what = "DDP's best final loss" if len(ddp) > 1 else "DDP's final loss"
    md = [f"Command: `{cmd}` ({took}). Loopback, 2 ranks, ~1M-parameter "
          f"`bench` preset, AdamW with a 20-step warm-up then constant; period {sw.period}; DDP "
          f"{sw.ddp_steps} steps, the others {sw.steps}; validation every {a.eval_every} steps. "
          f"Target = {what}: **{target:.3f}** (`{best}`, {ddp_bytes / 1e6:.0f} MB to reach "
          "it).", "",
          *head, *rows(ddp, target, ddp_bytes, sw.checkpoints),
          *rows(others, target, ddp_bytes, sw.checkpoints)]
    report.write_section(a.results_md, "\n".join(md), title=sw.section)
    with open(os.path.join(HERE, "results", sw.json_name), "w") as f:
        json.dump(dict(command=cmd, target=target, best_ddp=best, ddp_bytes_to_target=ddp_bytes,
                       runs={n: dict(config=r["config"], evals=r["evals"])
                             for n, r in {**ddp, **others}.items()}), f, indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
