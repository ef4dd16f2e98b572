"""The local step and the step time of our variants over ``none``'s, the variants taking
turns in one run.

``bench_train.py`` times each variant in its own ~30-60 s run, so a host whose speed
drifts on that scale moves every step-time ratio between repeats. Here every variant
trains in the same two processes (``harness/local_step.py``), in blocks of
``--block-steps`` steps, the order rotated every block; a *turn* is one block of each
variant, and each ratio is taken within a turn, then reported as the median over the
turns with their min-max:

- local step x: the median step that sent nothing and applied no round over ``none``'s
  median step (``bench_train.py``'s "local step / none");
- step time x: the mean step over ``none``'s mean step, every step of the block counted
  (rounds launched and applied included: ``bench_train.py``'s "step time x" without its
  validations);
- comm wait: the share of the step time spent in the averaging call and gradient sync.

A second table splits the mean step (every step of the block) into its parts, each the
median over the turns: forward and backward (and its ratio to ``none``'s in the same
turn), the training thread's own CPU time in them, the optimizer, the averaging call, and
the CPU time the process's other threads (the rounds' background coding, gloo's threads)
used during the step. On shared cores that CPU time comes out of the training threads:
the forward and backward's time less its CPU time is the time it waited for a core.

The first ``--skip`` steps of each block are left out (a round of the variant before
may still be finishing), and the first turn warms up. ``--runs`` measures every profile
and seed that many times, one after the other, and says how far the medians moved
between the runs. With ``--steps-from``, each part also composes the x of limit: the
steps x to DDP's loss of a ``bench_train.py`` run of the same link and seed (the median
over its repeats) times each run's step time x. Profiles as in
``bench_train.py``: ``loopback``, or two torchrun "nodes" in network namespaces joined at
``100mbit`` / ``25mbit``.

    python benchmarks/bench_local_step.py          # 100 and 25 Mbit/s, seeds 0 and 1
    python benchmarks/bench_local_step.py --profiles loopback --blocks 4 --preset tiny
    python benchmarks/bench_local_step.py --replot # the section again, from the JSON

Outputs: ``<out>/local_step_<profile>_seed<S>.json`` (each run's rows and per-turn
ratios), ``<out>/meta.json`` (the command, the load, the minutes), the run
folders under ``--runs-dir``, and the section "The local step, the variants taking turns
in one run" of ``benchmarks/RESULTS.md`` (``--title``: another section).
``--variant-args VARIANT=FLAGS`` gives one variant flags of its own (a period, fragments),
after ``--train-args``, as in ``bench_train.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch

from harness import launch, local_step, netns, records, report, variants

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "harness", "local_step.py")
VARIANTS = "none,fp16_streaming,int8_streaming,int4_streaming,int4_streaming_interleaved"
SECTION = "## The local step, the variants taking turns in one run"
TARGET = 1.05  # local step over none's
STEPS_FROM = ("100mbit=results/slow_link_best_seed{seed},"
              "25mbit=results/slow_link_25mbit_seed{seed}")
METRICS = ("local_x", "step_x", "comm")
#: the step's parts in the breakdown, in ms: ``harness/local_step.py``'s PARTS renamed
#: (``fwd_bwd_s`` -> ``fwd_bwd_ms``, ...)
PART_KEYS = tuple(part.removesuffix("_s") + "_ms" for part in local_step.PARTS)


def turn_ratios(turns: dict[str, list[dict]], none: str = "none", skip: int = 2) -> dict:
    """Per variant, one row per timed turn (block >= 1): its median local step and mean
    step in ms, their ratios to ``none``'s in the same turn, and its comm wait share.

    >>> rec = lambda b, s, n=0: dict(block=b, pos=2, step_s=s, bytes=n, averaged=n > 0,
    ...                              comm_s=0.0)
    >>> t = {"none": [rec(1, 0.10)], "x": [rec(1, 0.11), rec(1, 0.13, 8)]}
    >>> r = turn_ratios(t)["x"][0]
    >>> round(r["local_x"], 3), round(r["step_x"], 3)
    (1.1, 1.2)
    """
    per_block: dict[str, dict[int, dict]] = {}
    for name, recs in turns.items():
        blocks: dict[int, list[dict]] = {}
        for r in recs:
            if r["block"] >= 1 and r["pos"] >= skip:
                blocks.setdefault(r["block"], []).append(r)
        per_block[name] = {block: _block(rs) for block, rs in sorted(blocks.items())}
    out = {}
    for name, blocks in per_block.items():
        rows = []
        for block, b in blocks.items():
            ref = per_block[none].get(block)
            if ref is None:
                continue
            local_x = b["local_s"] / ref["local_s"] if b["local_s"] and ref["local_s"] \
                else None
            fwd_x = b["fwd_bwd_ms"] / ref["fwd_bwd_ms"] \
                if b["fwd_bwd_ms"] is not None and ref["fwd_bwd_ms"] else None
            rows.append(dict(turn=block, mean_ms=b["mean_s"] * 1e3,
                             step_x=b["mean_s"] / ref["mean_s"],
                             local_ms=b["local_s"] * 1e3 if b["local_s"] else None,
                             local_x=local_x, comm=b["comm"], fwd_bwd_x=fwd_x,
                             **{k: b[k] for k in PART_KEYS}))
        out[name] = rows
    return out


def _block(recs: list[dict]) -> dict:
    """One variant's block: its median local step (a step whose training thread sent
    nothing and launched no round, ``records.is_local_step``; ``None`` without one), its
    mean step, and its comm wait share."""
    local = [r["step_s"] for r in recs if records.is_local_step(r)]
    total = sum(r["step_s"] for r in recs)
    parts = {key: (sum(r[part] for r in recs) / len(recs) * 1e3
                   if all(part in r for r in recs) else None)  # runs made before the parts
             for key, part in zip(PART_KEYS, local_step.PARTS, strict=True)}
    return dict(local_s=statistics.median(local) if local else None, mean_s=total / len(recs),
                comm=sum(r["comm_s"] for r in recs) / total, **parts)


def summarize(ratios: dict[str, list[dict]]) -> list[dict]:
    """One row per variant: each of :data:`METRICS` and the step times in ms as the
    median over the turns (``report.aggregate``, the turns as its repeats), with
    ``<metric>_range`` (min, max), ``turns``, ``local_turns`` (turns with a local step:
    none where every step sends or applies a round) and ``local_met`` (turns with local
    step x <= 1.05)."""
    numbers = sorted({t["turn"] for rows in ratios.values() for t in rows})
    per_turn = [[dict(t, variant=name) for name, rows in ratios.items() for t in rows
                 if t["turn"] == k] for k in numbers]
    rows = report.aggregate(per_turn, keys=(*METRICS, "local_ms", "mean_ms", "fwd_bwd_x",
                                            *PART_KEYS))
    for r in rows:
        r["turns"] = r["repeats"]
        local = [v for v in r["local_x_values"] if v is not None]
        r["local_turns"], r["local_met"] = len(local), sum(v <= TARGET for v in local)
    return rows


def table(runs: list[list[dict]], none: str = "none") -> list[str]:
    """The rows of each run as markdown, variant by variant: medians over the turns,
    min-max in brackets; a column "run" where there is more than one."""
    def ranged(r, key, spec):
        if r[key] is None:
            return "n/a"
        lo, hi = r[f"{key}_range"]
        return f"{r[key]:{spec}} ({lo:{spec}}–{hi:{spec}})"
    many = len(runs) > 1
    lines = ["| variant | " + ("run | " if many else "") + "median local step, ms | "
             f"local step x `none` | turns <= {TARGET}x | mean step, ms | step time x `none` | "
             "comm wait |", "|---" * (7 + many) + "|"]
    for i, name in enumerate(r["variant"] for r in runs[0]):
        for k, rows in enumerate(runs):
            r, ours = rows[i], name != none
            lines.append("| " + " | ".join([
                f"`{name}`", *([str(k + 1)] if many else []),
                f"{r['local_ms']:.1f}" if r["local_ms"] else "n/a",
                ranged(r, "local_x", ".3f") if ours else "1",
                (f"{r['local_met']} of {r['local_turns']}" if r["local_turns"] else "n/a")
                if ours else "",
                f"{r['mean_ms']:.1f}", ranged(r, "step_x", ".3f") if ours else "1",
                ranged(r, "comm", ".1%")]) + " |")
    return lines


def overall_comm(runs: list[dict[str, list[dict]]], none: str = "none") -> str:
    """The comm wait over every timed step of each run (each turn weighted by its time),
    per variant: the share a whole run would report, bursts of late rounds included,
    where the table gives the median turn.

    >>> turn = lambda ms, comm: dict(mean_ms=ms, comm=comm)
    >>> overall_comm([{"none": [], "x": [turn(10, 0.01), turn(30, 0.05)]}]).split(": ")[-1]
    '`x` 4.0%.'
    """
    cells = []
    for name in runs[0]:
        if name == none:
            continue
        shares = []
        for turns in runs:
            total = sum(t["mean_ms"] for t in turns[name])
            shares.append(sum(t["comm"] * t["mean_ms"] for t in turns[name]) / total
                          if total else 0.0)
        cells.append(f"`{name}` " + " / ".join(f"{x:.1%}" for x in shares))
    return ("Comm wait over every timed step (the turns weighted by their time; the table "
            "gives the median turn): " + "; ".join(cells) + ".")


def breakdown(runs: list[list[dict]], none: str = "none") -> list[str]:
    """The parts of each run's mean step as markdown, variant by variant (medians over
    the turns); no lines for runs made before the parts were kept."""
    if any(r.get("fwd_bwd_ms") is None for rows in runs for r in rows):
        return []
    many = len(runs) > 1
    cpu = all(r.get("fwd_bwd_cpu_ms") is not None for rows in runs for r in rows)
    lines = ["| variant | " + ("run | " if many else "") + "forward and backward, ms | "
             "x `none` | " + ("its CPU time, ms | " if cpu else "") + "optimizer, ms | "
             "averaging call, ms | other threads' CPU, ms a step |",
             "|---" * (6 + cpu + many) + "|"]
    for i, name in enumerate(r["variant"] for r in runs[0]):
        for k, rows in enumerate(runs):
            r = rows[i]
            lo, hi = r["fwd_bwd_x_range"]
            lines.append("| " + " | ".join([
                f"`{name}`", *([str(k + 1)] if many else []), f"{r['fwd_bwd_ms']:.1f}",
                f"{r['fwd_bwd_x']:.3f} ({lo:.3f}–{hi:.3f})" if name != none else "1",
                *([f"{r['fwd_bwd_cpu_ms']:.1f}"] if cpu else []), f"{r['opt_ms']:.2f}",
                f"{r['avg_ms']:.2f}", f"{r['other_cpu_ms']:.2f}"]) + " |")
    return lines


def between_runs(runs: list[list[dict]], none: str = "none") -> dict[str, float]:
    """Per metric, the largest move of a variant's median from one run to another.

    >>> rows = lambda x: [dict(variant="none", local_x=None, step_x=None, comm=0.0),
    ...                   dict(variant="a", local_x=x, step_x=1.0, comm=0.01)]
    >>> between_runs([rows(1.02), rows(1.05)])["local_x"]
    0.03
    """
    out = {}
    for key in METRICS:
        moves = [max(v) - min(v) for i, r in enumerate(runs[0]) if r["variant"] != none
                 for v in [[rows[i][key] for rows in runs if rows[i][key] is not None]] if v]
        out[key] = round(max(moves), 6) if moves else 0.0
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default="100mbit,25mbit")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--variants", default=VARIANTS,
                   help="harness/train.py --hook names, the first the baseline of the ratios")
    p.add_argument("--blocks", type=int, default=30, help="timed turns")
    p.add_argument("--block-steps", type=int, default=local_step.BLOCK_STEPS)
    p.add_argument("--skip", type=int, default=2, help="steps left out at each block's start")
    p.add_argument("--runs", type=int, default=2,
                   help="runs of every profile and seed, one after the other: how far the "
                        "medians move between runs")
    p.add_argument("--preset", default="bench")
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-args", default="", help="more harness/train.py flags for every variant")
    p.add_argument("--variant-args", action="append", default=[], metavar="VARIANT=FLAGS",
                   help="more harness/train.py flags for one variant, after all others "
                        "(repeatable; e.g. 'int2_streaming_interleaved=--period 4')")
    p.add_argument("--steps-from", default=STEPS_FROM, metavar="PROFILE=DIR,...",
                   help="bench_train.py results (DIR/train_summary.json, '{seed}' replaced) "
                        "whose steps x, times each run's step time x, give the x of limit")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default=os.path.join(HERE, "results", "local_step"))
    p.add_argument("--runs-dir", default=os.path.join(HERE, os.pardir, "out", "local_step"))
    p.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--title", default=SECTION[3:],
                   help="the RESULTS.md section's heading (without the '## '): another "
                        "title keeps the default section as it is")
    p.add_argument("--replot", action="store_true",
                   help="rebuild the section from the JSON in --out; no training")
    a = p.parse_args(argv)
    names = a.variants.split(",")
    why = [w for w in map(local_step.refused, names) if w]
    if why:
        p.error("; ".join(why))
    try:
        variants.variant_flags(a.variant_args, names)
    except ValueError as exc:
        p.error(str(exc))
    if a.runs < 1:
        p.error(f"--runs {a.runs}: at least 1")
    if a.skip >= a.block_steps:
        p.error(f"--skip {a.skip} leaves no step of a --block-steps {a.block_steps} block")
    try:
        steps_from = _steps_from(a.steps_from)
    except ValueError as exc:
        p.error(str(exc))
    unknown = [n for n in a.profiles.split(",") if n not in netns.PROFILES]
    if unknown:
        p.error(f"--profiles {a.profiles}: unknown {', '.join(unknown)}; choose from "
                f"{', '.join(sorted(netns.PROFILES))}")
    try:
        seeds = [int(seed) for seed in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds}: expected comma-separated integers, e.g. 0,1")
    profiles = [netns.PROFILES[n] for n in a.profiles.split(",")]
    keys = [(prof, seed) for prof in profiles for seed in seeds]
    if a.replot:
        done, meta = _load(a.out, keys)
    else:
        ok, reason = netns.netns_available()
        if any(prof.shaped for prof in profiles):
            if not ok:
                p.error(f"--profiles {a.profiles}: {reason}; use --profiles loopback")
            netns.cleanup_stale()
        done, meta = _measure(a, keys, names, argv)
    md = [f"Command: `{meta['command']}` (torch {meta['torch']}, {meta['cores']} cores, "
          f"load average {meta['load_start']:.1f} at start, {meta['load_end']:.1f} at the "
          f"end; {meta['minutes']:.1f} min in all).", ""]
    for (prof, seed), runs in done.items():
        md += _part(prof.name, seed, runs, names[0], a.skip, steps_from.get(prof.name))
    with open(os.path.join(a.out, "section.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    report.write_section(a.results_md, _intro() + "\n\n" + "\n".join(md),
                         title="## " + a.title)
    return 0


def _measure(a, keys: list, names: list[str], argv) -> tuple[dict, dict]:
    """Every profile and seed ``a.runs`` times: the runs' rows and turns, and the meta
    block of the section (also in ``<out>/meta.json``)."""
    os.makedirs(a.out, exist_ok=True)
    t_start, load0 = time.time(), os.getloadavg()[0]
    cmd = "python benchmarks/bench_local_step.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    done: dict[tuple, list[dict]] = {k: [] for k in keys}
    for n in range(a.runs):  # run 2 of every profile and seed after run 1 of all of them
        for prof, seed in keys:
            run = _run(a, prof, seed, n)
            ratios = turn_ratios(run["turns"], none=names[0], skip=a.skip)
            done[(prof, seed)].append(dict(network=run["launch"]["network"],
                                           config=run["config"], rows=summarize(ratios),
                                           turns=ratios))
            print("\n".join(table([done[(prof, seed)][-1]["rows"]], names[0])), flush=True)
            with open(os.path.join(a.out, f"local_step_{prof.name}_seed{seed}.json"), "w") as f:
                json.dump(dict(command=cmd, runs=done[(prof, seed)]), f, indent=1)
    meta = dict(command=cmd.strip(), torch=torch.__version__, cores=os.cpu_count(),
                load_start=load0, load_end=os.getloadavg()[0],
                minutes=(time.time() - t_start) / 60)
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return done, meta


def _load(out: str, keys: list) -> tuple[dict, dict]:
    """What :func:`_measure` saved in ``out``, for ``keys``; each run's rows summarized
    again from its saved per-turn ratios."""
    try:
        with open(os.path.join(out, "meta.json")) as f:
            meta = json.load(f)
        done = {}
        for prof, seed in keys:
            with open(os.path.join(out, f"local_step_{prof.name}_seed{seed}.json")) as f:
                done[(prof, seed)] = [dict(run, rows=summarize(run["turns"]))
                                      for run in json.load(f)["runs"]]
    except FileNotFoundError as exc:
        raise SystemExit(f"--replot: {exc.filename} is missing; pass as --out the folder of "
                         "a finished run, with its --profiles and --seeds") from None
    return done, meta


def _part(profile: str, seed: int, runs: list[dict], none: str, skip: int,
          steps_dir: str | None) -> list[str]:
    """The section's part for one profile and seed: the runs' table, how far the medians
    moved between them, and the x of limit composed with ``steps_dir``'s steps x."""
    cfg, rows = runs[0]["config"], [r["rows"] for r in runs]
    minutes = ", ".join(f"{r['config']['elapsed_s'] / 60:.1f}" for r in runs)
    out = [f"#### {profile}, seed {seed}: {runs[0]['network']}", "",
           f"{len(rows[0])} variants in {cfg['blocks']} timed turns of {cfg['block_steps']} "
           f"steps each (the first {skip} of each block left out), {len(runs)} "
           f"run{'s' if len(runs) > 1 else ''} ({minutes} min); medians over the turns, "
           "min-max in brackets." + _flags_note(cfg), "", *table(rows, none), ""]
    parts = breakdown(rows, none)
    if parts:
        out += ["Where the mean step goes (medians over the turns):", "", *parts, ""]
    out += [overall_comm([r["turns"] for r in runs], none), ""]
    if len(runs) > 1:
        moved = between_runs(rows, none)
        out += [f"Between the runs, a variant's median moved by at most "
                f"{moved['local_x']:.3f} (local step x), {moved['step_x']:.3f} (step time "
                f"x) and {moved['comm']:.1%} (comm wait).", ""]
    if steps_dir:
        out += composed_limit(rows, steps_dir.format(seed=seed), profile, none) + [""]
    return out


def _flags_note(config: dict) -> str:
    """' Each variant's own flags: ...' from a run's config ('' without any).

    >>> _flags_note(dict(variant_flags={"x": ["--period", "4"]}))
    " Each variant's own flags: `x` `--period 4`."
    """
    own = config.get("variant_flags") or {}
    if not own:
        return ""
    return " Each variant's own flags: " + "; ".join(
        f"`{v}` `{shlex.join(f)}`" for v, f in own.items()) + "."


def composed_limit(runs: list[list[dict]], steps_dir: str, profile: str,
                   none: str = "none") -> list[str]:
    """x of limit = steps x (median over the repeats of ``steps_dir``'s run of
    ``bench_train.py``) times each run's step time x, for the variants in both."""
    path = os.path.join(steps_dir, "train_summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except FileNotFoundError:
        return [f"(No x of limit: {path} is missing.)"]
    steps = {r["variant"]: r.get("steps_x") for r in summary["rows"].get(profile, [])}
    limit = report.LIMIT_TARGETS.get(profile)
    goal = f"; target <= {limit}x" if limit else ""
    cells = []
    for i, r in enumerate(runs[0]):
        sx = steps.get(r["variant"])
        if r["variant"] == none or sx is None:
            continue
        composed = [sx * rows[i]["step_x"] for rows in runs]
        cells.append(f"`{r['variant']}` {sx:.2f} x " + " / ".join(
            f"{rows[i]['step_x']:.3f}" for rows in runs) + " = " + " / ".join(
            f"{c:.2f}" for c in composed))
    rel = os.path.relpath(steps_dir, HERE)
    return [f"x of limit composed: steps x to DDP's loss (`{rel}`, median over its repeats) "
            f"times each run's step time x{goal}: " + "; ".join(cells) + "."]


def _steps_from(text: str) -> dict[str, str]:
    """``--steps-from`` as ``{profile: folder}`` (relative to ``benchmarks/``).

    >>> _steps_from("25mbit=results/x_seed{seed}")["25mbit"].endswith("results/x_seed{seed}")
    True
    """
    out = {}
    for part in filter(None, text.split(",")):
        prof, sep, folder = part.partition("=")
        if not sep or prof not in netns.PROFILES or not folder:
            raise ValueError(f"--steps-from {part!r}: expected PROFILE=DIR with PROFILE one "
                             f"of {', '.join(sorted(netns.PROFILES))}")
        out[prof] = os.path.join(HERE, folder)
    return out


def _intro() -> str:
    return ("Every variant trains in the same two processes, in blocks of steps, the order "
            "rotated every block; a turn is one block of each, and each ratio is taken within "
            "a turn (`benchmarks/bench_local_step.py`, whose docstring defines the columns). "
            "The host's drift reaches every variant alike, which one run per variant cannot "
            "promise.")


def _run(a, prof, seed: int, n: int) -> dict:
    args = ["--variants", a.variants, "--blocks", str(a.blocks), "--block-steps",
            str(a.block_steps), "--preset", a.preset, "--period", str(a.period), "--lr",
            str(a.lr), "--seed", str(seed), "--progress", "off", *shlex.split(a.train_args),
            *[arg for spec in a.variant_args for arg in ("--variant-args", spec)]]
    out = os.path.join(a.runs_dir, f"{prof.name}_seed{seed}_run{n + 1}")
    t0 = time.time()
    if prof.shaped:
        with netns.NetnsPair(prof) as pair:
            run = launch.run_training(args, out, pair=pair, timeout_s=a.timeout, script=SCRIPT)
    else:
        run = launch.run_training(args, out, timeout_s=a.timeout, script=SCRIPT)
    print(f"{prof.name} seed {seed}, run {n + 1}: {time.time() - t0:.0f} s", file=sys.stderr,
          flush=True)
    return run


if __name__ == "__main__":
    sys.exit(main())
