"""Loopback studies of steps to DDP's loss: named configurations of ``train.py``, over seeds.

The number of steps to a loss does not depend on the link, so these studies train on
loopback: 2 ranks, the ``bench`` preset, validation every 20 steps. Each configuration
(``train.py`` flags, one of them ``"ddp"``, the reference) trains once per seed; steps to
DDP's loss after ``budget`` steps are interpolated between the two validations around it.

>>> run = lambda *vs: {"evals": [{"step": 20 * (k + 1), "val_loss": v, "bytes": 10 * (k + 1)}
...                              for k, v in enumerate(vs)]}
>>> runs = {0: {"ddp": run(3.0, 2.0), "a": run(3.0, 2.5, 2.0)}}
>>> print("\\n".join(table(runs, ["a"], budget=40)))
| configuration | seed 0 | mean |
|---|---|---|
| `a` | 1.500 | 1.500 |
<BLANKLINE>
"""
from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import time

from . import launch, report

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_all(configs: dict[str, list[str]], seeds: list[int], runs_dir: str, *,
              steps: int, budget: int, timeout_s: float,
              reused: list[str] | None = None) -> dict[int, dict[str, dict]]:
    """Train every configuration once per seed; ``{seed: {name: metrics}}``.

    With ``reused`` (a list), a run whose ``metrics.json`` in ``runs_dir`` was made by the
    same ``train.py`` arguments (:func:`same_arguments`) is read instead of trained again,
    and its ``seed/name`` appended to ``reused``."""
    runs: dict[int, dict[str, dict]] = {}
    for seed in seeds:
        runs[seed] = {}
        for name, flags in configs.items():
            args = ["--preset", "bench", "--steps", str(steps), "--eval-every", "20",
                    "--seed", str(seed), "--progress", "off", *flags]
            out = os.path.join(runs_dir, f"seed{seed}", re.sub(r"[^A-Za-z0-9_]+", "_", name))
            earlier = _earlier_run(out, args) if reused is not None else None
            if earlier is not None:
                reused.append(f"{seed}/{name}")
            runs[seed][name] = earlier or launch.run_training(args, out, timeout_s=timeout_s)
            print(f"seed {seed} {name}: loss @ {budget} "
                  f"{report.loss_at_step(runs[seed][name], budget):.4f}"
                  + (" (reused)" if earlier is not None else ""), file=sys.stderr, flush=True)
    return runs


def same_arguments(config: dict, parsed: dict) -> bool:
    """Whether a run's recorded ``config`` holds every parsed ``train.py`` argument with
    the same value (``--out`` aside: where a run is written does not change it).

    >>> same_arguments({"seed": 0, "lr": 0.001, "out": "a", "n_params": 5},
    ...                {"seed": 0, "lr": 0.001, "out": "b"})
    True
    >>> same_arguments({"seed": 0, "lr": 0.001}, {"seed": 0, "lr": 0.002})
    False
    """
    return all(k in config and config[k] == v for k, v in parsed.items() if k != "out")


def _earlier_run(out: str, args: list[str]) -> dict | None:
    path = os.path.join(out, "metrics.json")
    if not os.path.exists(path):
        return None
    try:
        from . import train
    except ImportError:  # benchmarks/harness on sys.path, as train.py runs itself
        import train
    with open(path) as f:
        run = json.load(f)
    return run if same_arguments(run.get("config", {}), vars(train.parse_args(args))) else None


def ratios(runs: dict[int, dict[str, dict]], name: str, *, budget: int,
           reference: str = "ddp") -> list[float | None]:
    """Per seed, ``name``'s steps to ``reference``'s loss at ``budget`` steps over
    ``budget`` (interpolated; ``None`` where it never reached it).

    >>> run = lambda *vs: {"evals": [{"step": 20 * (k + 1), "val_loss": v}
    ...                              for k, v in enumerate(vs)]}
    >>> ratios({0: {"ddp": run(3.0, 2.0), "a": run(3.0, 2.5, 2.0)}}, "a", budget=40)
    [1.5]
    """
    out = []
    for s in sorted(runs):
        target = report.loss_at_step(runs[s][reference], budget)
        st = report.steps_to_target(runs[s][name], target, interpolate=True)
        out.append(None if st is None else st / budget)
    return out


def pooled_table(runs: dict[int, dict[str, dict]], pools: dict[str, dict[str, str]], *,
                 budget: int, within: float) -> list[str]:
    """Markdown rows: per pool (``{label: {name: reference}}``), every seed's ratio of each
    of its configurations to its reference pooled into one sample: its size, mean and
    median, each with its 95% interval (percentile bootstrap, 10,000 resamples, seeded:
    the same sample gives the same interval), and how many are at most ``within``.

    >>> run = lambda *vs: {"evals": [{"step": 20 * (k + 1), "val_loss": v}
    ...                              for k, v in enumerate(vs)]}
    >>> runs = {0: {"ddp": run(3.0, 2.0), "ddp2": run(3.0, 1.9),
    ...             "a": run(3.0, 2.0), "a2": run(2.9, 2.1, 1.9)}}
    >>> pools = {"a, both": {"a": "ddp", "a2": "ddp2"}}
    >>> print("\\n".join(pooled_table(runs, pools, budget=40, within=1.1)))
    | configuration | samples | mean (95% interval) | median (95% interval) | within 1.10x |
    |---|---|---|---|---|
    | a, both | 2 | 1.250 (1.000-1.500) | 1.250 (1.000-1.500) | 1 of 2 |
    <BLANKLINE>
    """
    lines = [f"| configuration | samples | mean (95% interval) | median (95% interval) | "
             f"within {within:.2f}x |", "|---|---|---|---|---|"]
    for label, members in pools.items():
        sample = [r for name, ref in members.items()
                  for r in ratios(runs, name, budget=budget, reference=ref)]
        reached = [r for r in sample if r is not None]
        whole = len(reached) == len(sample)
        stats = " | ".join(f"{f(reached):.3f} ({low:.3f}-{high:.3f})"
                           for f in (statistics.mean, statistics.median)
                           for low, high in [bootstrap_interval(reached, f)]) if whole else "- | -"
        lines.append(f"| {label} | {len(sample)} | {stats} | "
                     f"{sum(r <= within for r in reached)} of {len(sample)} |")
    return lines + [""]


def bootstrap_interval(sample: list[float], statistic, *, resamples: int = 10_000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of ``statistic`` over ``sample``: the statistic of
    ``resamples`` draws of ``len(sample)`` values with replacement, its ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles. Seeded, so a sample always gives the same interval.

    >>> bootstrap_interval([1.0, 1.0, 1.0], statistics.mean)
    (1.0, 1.0)
    >>> low, high = bootstrap_interval([1.0, 1.1, 1.2, 1.3], statistics.mean)
    >>> 1.0 <= low < 1.15 < high <= 1.3
    True
    """
    draw = random.Random(seed)
    values = sorted(statistic(draw.choices(sample, k=len(sample))) for _ in range(resamples))
    return (values[int((1 - level) / 2 * resamples)],
            values[min(resamples - 1, int((1 + level) / 2 * resamples))])


def table(runs: dict[int, dict[str, dict]], names: list[str], *, budget: int,
          bytes_base: str | dict[str, str] | None = None, within: float | None = None,
          references: dict[str, str] | None = None) -> list[str]:
    """Markdown rows: each of ``names``' steps to DDP's loss at ``budget`` steps over
    ``budget``, per seed and their mean; with ``within``, also their median and on how
    many seeds the ratio is at most ``within``; with ``bytes_base``, the median over seeds
    of the bytes sent to that loss over ``bytes_base``'s (a name, or one per row).
    ``references`` names, per row, the run whose loss it is measured against (default
    ``"ddp"``).

    >>> run = lambda *vs: {"evals": [{"step": 20 * (k + 1), "val_loss": v, "bytes": 1}
    ...                              for k, v in enumerate(vs)]}
    >>> runs = {s: {"ddp": run(3.0, 2.0), "a": run(3.0, 2.0 + s / 10, 1.8)} for s in (0, 1, 2)}
    >>> print("\\n".join(table(runs, ["a"], budget=40, within=1.1)))
    | configuration | seed 0 | seed 1 | seed 2 | mean | median | within 1.10x |
    |---|---|---|---|---|---|---|
    | `a` | 1.000 | 1.167 | 1.250 | 1.139 | 1.167 | 1 of 3 |
    <BLANKLINE>
    """
    seeds = sorted(runs)
    head = " | ".join(f"seed {s}" for s in seeds)
    spread = f" median | within {within:.2f}x |" if within else ""
    extra = " bytes x |" if bytes_base else ""
    lines = [f"| configuration | {head} | mean |{spread}{extra}",
             "|" + "---|" * (len(seeds) + 2 + 2 * bool(within) + bool(bytes_base))]
    for name in names:
        reference = (references or {}).get(name, "ddp")
        base = bytes_base.get(name) if isinstance(bytes_base, dict) else bytes_base
        per_seed = ratios(runs, name, budget=budget, reference=reference)
        cells = ["not reached" if r is None else f"{r:.3f}" for r in per_seed]
        reached = [r for r in per_seed if r is not None]
        sent = []
        for s in seeds:
            if base:
                target = report.loss_at_step(runs[s][reference], budget)
                b, b_base = (report.bytes_to_target(runs[s][v], target) for v in (name, base))
                if b and b_base:
                    sent.append(b / b_base)
        whole = len(reached) == len(seeds)
        mean = f"{statistics.mean(reached):.3f}" if whole else "-"
        row = f"| `{name}` | " + " | ".join(cells) + f" | {mean} |"
        if within:
            median = f"{statistics.median(reached):.3f}" if whole else "-"
            row += f" {median} | {sum(r <= within for r in reached)} of {len(seeds)} |"
        if bytes_base:
            row += f" {statistics.median(sent):.1f} |" if sent else " - |"
        lines.append(row)
    return lines + [""]


def loss_table(runs: dict[int, dict[str, dict]], names: list[str], *, budget: int,
               base: str) -> list[str]:
    """Markdown rows: each of ``names``' validation loss after ``budget`` steps, per seed,
    with its gap to ``base``'s loss on that seed; then the mean gap, the largest, and the
    median over seeds of the bytes sent in those steps over ``base``'s.

    >>> run = lambda v, b: {"evals": [{"step": 200, "val_loss": v, "bytes": b}]}
    >>> runs = {0: {"pma": run(2.0, 8), "a": run(2.02, 1)},
    ...         1: {"pma": run(2.5, 8), "a": run(2.4, 1)}}
    >>> print("\\n".join(loss_table(runs, ["pma", "a"], budget=200, base="pma")))
    | configuration | seed 0 | seed 1 | mean gap | largest gap | bytes x |
    |---|---|---|---|---|---|
    | `pma` | 2.000 | 2.500 | +0.00% | +0.00% | 1.000 |
    | `a` | 2.020 (+1.00%) | 2.400 (-4.00%) | -1.50% | -4.00% | 0.125 |
    <BLANKLINE>
    """
    seeds = sorted(runs)
    lines = ["| configuration | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean gap | largest gap | bytes x |", "|" + "---|" * (len(seeds) + 4)]
    for name in names:
        cells, gaps, sent = [], [], []
        for s in seeds:
            loss, ref = (report.loss_at_step(runs[s][n], budget) for n in (name, base))
            if loss is None or ref is None:
                cells.append("-")
                continue
            b, b_ref = (_bytes_at_step(runs[s][n], budget) for n in (name, base))
            if b_ref:
                sent.append(b / b_ref)
            gaps.append(loss / ref - 1)
            cells.append(f"{loss:.3f}" + ("" if name == base else f" ({gaps[-1]:+.2%})"))
        whole = len(gaps) == len(seeds)
        mean = f"{statistics.mean(gaps):+.2%}" if whole else "-"
        largest = f"{max(gaps, key=abs):+.2%}" if whole else "-"
        ratio = f"{statistics.median(sent):.3f}" if sent else "-"
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {mean} | {largest} | {ratio} |")
    return lines + [""]


def _bytes_at_step(run: dict, step: int) -> float:
    return next(e["bytes"] for e in run["evals"] if e["step"] == step)


def save(path: str, command: str, runs: dict[int, dict[str, dict]]) -> None:
    """Write the command and every run's configuration and validations as JSON."""
    with open(path, "w") as f:
        json.dump(dict(command=command, runs={str(s): {n: dict(config=r["config"], evals=r["evals"])
                                                       for n, r in v.items()}
                                              for s, v in runs.items()}), f, indent=1)


def _bases_text(bytes_base: str | dict[str, str]) -> str:
    """Whose bytes a table's bytes column divides by, in words.

    >>> _bases_text({"a": "x", "b": "x", "c": "y"})
    "`x`'s (`y`'s for `c`)"
    """
    if isinstance(bytes_base, str):
        return f"`{bytes_base}`'s"
    bases = list(bytes_base.values())
    usual = max(bases, key=bases.count)
    others = [f"`{b}`'s for " + ", ".join(f"`{n}`" for n, m in bytes_base.items() if m == b)
              for b in dict.fromkeys(bases) if b != usual]
    return f"`{usual}`'s" + (f" ({'; '.join(others)})" if others else "")


def main(doc: str, script: str, *, section: str, json_name: str,
         configs: dict[str, list[str]], describe: str, bytes_base: str | dict[str, str],
         loss_base: str | None = None, within: float | None = None, lr: float = 1e-3,
         lr_warmup: int = 20, steps: int = 300, budget: int = 200,
         later_budgets: tuple[int, ...] = (), seeds: str = "0,1,2,3,4",
         references: dict[str, str] | None = None,
         pools: dict[str, dict[str, str]] | None = None, argv=None) -> int:
    """A study's command line: train ``configs`` (each at ``--lr lr``, warmed up over
    ``lr_warmup`` steps) over ``--seeds`` (default ``seeds``),
    then write the section ``section`` of RESULTS.md (the setting, ``describe``, and the
    table of every configuration but ``"ddp"``, each against its run in ``references``,
    default ``"ddp"``; with ``loss_base``, also every configuration's loss after
    ``budget`` steps against ``loss_base``'s; with ``within``, the median ratio and the
    seeds within it, and the ``pools`` of :func:`pooled_table`; the same table and pools
    again for each of ``later_budgets``, DDP's loss after that many steps of the same
    runs) and ``results/json_name``."""
    a = launch.study_args(doc, seeds, os.path.splitext(json_name)[0], argv, reuse=True)
    t0 = time.time()
    reused: list[str] = []
    runs = train_all({name: ["--lr", str(lr), "--lr-warmup", str(lr_warmup), *flags]
                      for name, flags in configs.items()},
                     [int(s) for s in a.seeds.split(",")], a.runs_dir,
                     steps=steps, budget=budget, timeout_s=a.timeout,
                     **({"reused": reused} if a.reuse else {}))
    cmd = f"python benchmarks/{script}" + "".join(f" {x}" for x in (argv or sys.argv[1:]))
    total = sum(len(v) for v in runs.values())
    note = (f"; {len(reused)} of {total} runs reused from --runs-dir, made by the same "
            "train.py arguments" if reused else "")
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min{note}). Loopback, 2 ranks, "
          f"~1M-parameter `bench` preset, batch 8 per rank, AdamW at lr {lr:g} (after a "
          f"{lr_warmup}-step warm-up), {steps} steps, validation every 20 steps. {describe}", "",
          f"Steps to DDP's loss at {budget} steps, over DDP's {budget} (interpolated); bytes "
          f"sent by rank 0 to that loss over {_bases_text(bytes_base)}:", "",
          *table(runs, [n for n in configs if n != "ddp"], budget=budget,
                 bytes_base=bytes_base, within=within, references=references)]
    if pools and within:
        md += ["Pooled over the rows of each line, every seed's ratio one sample:", "",
               *pooled_table(runs, pools, budget=budget, within=within)]
    for later in later_budgets:
        md += [f"Steps to DDP's loss at {later} steps of the same runs, over DDP's {later}:", "",
               *table(runs, [n for n in configs if n != "ddp"], budget=later,
                      bytes_base=bytes_base, within=within, references=references)]
        if pools and within:
            md += [f"Pooled, at {later} steps:", "",
                   *pooled_table(runs, pools, budget=later, within=within)]
    if loss_base:
        md += [f"Validation loss after {budget} steps (DDP's budget), and its gap to "
               f"`{loss_base}`'s on the same seed; bytes sent by rank 0 in those steps over "
               f"`{loss_base}`'s:", "",
               *loss_table(runs, list(configs), budget=budget, base=loss_base)]
    report.write_section(a.results_md, "\n".join(md).rstrip() + "\n", title=section)
    save(os.path.join(BENCHMARKS, "results", json_name), cmd, runs)
    print("\n".join(md))
    return 0
