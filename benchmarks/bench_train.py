"""End-to-end benchmark: local SGD against DDP on real training, under network profiles.

Runs ``harness/train.py`` (2 CPU ranks, a char-level transformer on the
Python stdlib source) for every variant, under every profile, in this one invocation:

- variants: ``none`` (no communication: each rank alone, the physical limit), ``ddp``,
  ``ddp_fp16`` and ``ddp_powersgd`` (PyTorch's gradient comm hooks), ``torch_localsgd``
  (PyTorch's ``PeriodicModelAverager`` + ``post_localSGD_hook``), ``accelerate_localsgd``
  (Accelerate's ``LocalSGD``), and ours with each built-in hook (``allreduce``, ``fp16``,
  ``bf16``, ``powersgd``); local SGD at ``--period``. DiLoCo at period 32: ours
  (``diloco``, ``diloco_fp16``, ``diloco_streaming``) and torchft's (``torchft_diloco``,
  ``torchft_streaming_diloco``). A peer whose package is not installed is reported as not run.
- profiles: ``loopback``; ``1gbit``, ``100mbit`` and ``25mbit`` as two torchrun "nodes" in
  two network namespaces joined by a veth pair shaped with ``tc tbf`` (a fresh pair per run,
  torn down on exit even on failure). Without root or ``ip netns`` it says so and runs
  loopback only. This kernel has no ``netem``: no delay is applied, and the output says so.
- budget: DDP (run first) and ``none`` run ``--steps``; every other variant runs at least
  that and at most twice that, stopping at the first validation at or below DDP's final
  validation loss (the target).

Outputs: ``benchmarks/results/train_<profile>.json`` (every run: config, summary,
validation curve, per-step columns), ``benchmarks/results/train_summary.json`` (the rows),
``benchmarks/results/train.png`` (validation loss vs wall-clock and vs MB sent) and the
section "End-to-end training" of ``benchmarks/RESULTS.md``.

    python benchmarks/bench_train.py                      # the full run (tens of minutes)
    python benchmarks/bench_train.py --quick              # a smoke test of the pipeline

Uneven workers (``harness/uneven.py``): a profile ``<network>+jitter`` or
``<network>+slow-rank`` (or ``--uneven jitter,slow-rank``: every ``--profiles`` entry
with each mode) runs the same variants with a per-step random slowdown (a sleep) or one
rank held at 1/1.5 of a CPU by a cgroup CPU quota; its table adds each rank's steps,
mean step and compute time and each rank's idle share. The time-based variants
(``allreduce_timed``, ``fp16_timed``, ``allreduce_timed_equal``, ``fp16_timed_overlap``,
``fp16_timed_equal_overlap``: ``schedules.EverySeconds``, the last two with ``overlap=True``,
``harness/timed_loop.py``) round every ``--round-seconds`` (default: the seconds per round
of ``allreduce`` at ``--period`` in the same profile), for as many rounds as ``--period``
makes in the step budget.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import shlex
import sys
import time

import torch

from harness import launch, netns, report, uneven
from harness.train import split_available
from harness.variants import TIMED, names_of, variant_flags
from harness.variants import VARIANTS as VARIANT_SPECS

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
VARIANTS = ["ddp", "none", "ddp_fp16", "ddp_powersgd", "torch_localsgd", "accelerate_localsgd",
            "allreduce", "fp16", "bf16", "powersgd"]
# overlapped rounds, and DiLoCo at period 32
OVERLAP_DILOCO_VARIANTS = ["allreduce_overlap", "fp16_overlap", "diloco", "diloco_fp16",
                           "diloco_streaming", "torchft_diloco", "torchft_streaming_diloco"]
VARIANTS += OVERLAP_DILOCO_VARIANTS
DILOCO_VARIANTS = {"diloco", "diloco_fp16", "diloco_streaming", "diloco_int4",
                   "diloco_int4_streaming", "torchft_diloco", "torchft_streaming_diloco",
                   "fsdp_diloco", "torchft_fsdp_diloco"}
DILOCO_PERIOD = 32
# hierarchical averaging: two "nodes" (namespaces) of --nproc / 2 ranks; not in the default
# run (2 ranks: one per node), see --nproc
HIERARCHICAL = "hierarchical"
# rounds every --round-seconds (not in the default run; see --uneven)
TIMED_VARIANTS = names_of(TIMED)


def _columnar(run: dict) -> dict:
    """Per-step records as columns (a third of the size in JSON)."""
    steps = run.pop("steps")
    run["step_columns"] = {k: [s[k] for s in steps] for k in steps[0]} if steps else {}
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default="loopback,1gbit,100mbit")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--preset", default="bench")
    p.add_argument("--steps", type=int, default=200, help="DDP's step budget (others: 2x)")
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--uneven", default="",
                   help="uneven workers: also run every profile as <profile>+<mode>, for each "
                        f"mode of {','.join(uneven.MODES)} (or name them in --profiles)")
    p.add_argument("--round-seconds", type=float, default=None,
                   help="*_timed variants: seconds between rounds (default: allreduce's "
                        "seconds per round in the same profile, else 8 x DDP's mean step)")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks in all; shaped profiles put half on each of the two nodes")
    p.add_argument("--intra-period", type=int, default=2,
                   help="hierarchical: steps between exact rounds inside a node")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="(inner) AdamW learning rate of every variant but DiLoCo's")
    p.add_argument("--diloco-lr", type=float, default=3e-4,
                   help="DiLoCo's inner learning rate (its outer Nesterov step is up to 7x a "
                        "round's)")
    p.add_argument("--eval-every", type=int, default=20,
                   help="steps between validations (times and steps to the target are "
                        "interpolated between the two around it)")
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved repeats: each runs every variant once, in an order rotated "
                        "by one per repeat; ratios are computed within a repeat and reported as "
                        "the median (min-max) over the repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-args", default="",
                   help="more flags for every training run (harness/train.py's, e.g. "
                        "'--mixing 0.5 --fragments 2'); a variant's own flags come after")
    p.add_argument("--variant-args", action="append", default=[], metavar="VARIANT=FLAGS",
                   help="more flags for one variant's runs, after all others (repeatable; e.g. "
                        "'int4_streaming=--lr 7e-4')")
    p.add_argument("--baseline", default="ddp",
                   help="the variant whose final loss is the target and whose budget is --steps "
                        "(the FSDP2 runs: hsdp_native)")
    p.add_argument("--none", default="none",
                   help="the variant that never communicates, the limit's step time (the FSDP2 "
                        "runs: fsdp_none)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per training run")
    p.add_argument("--out", default=RESULTS,
                   help="JSON and plot; a sub-folder of results/ adds a part to the RESULTS.md "
                        "section")
    p.add_argument("--title", default="Main run: ~1M-parameter model, three profiles")
    p.add_argument("--runs-dir", default=os.path.join(HERE, os.pardir, "out", "bench_train"),
                   help="per-run metrics.json and launch.log (not committed)")
    p.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--quick", action="store_true", help="tiny model, 48 steps: pipeline check only")
    p.add_argument("--replot", action="store_true",
                   help="rebuild plot, summary and RESULTS.md from the JSON in --out, with the "
                   "flags of the run that wrote it; no training")
    a = p.parse_args(argv)
    if a.replot:  # every flag but --out and --results-md from the run's own command
        summary = os.path.join(a.out, "train_summary.json")
        if not os.path.exists(summary):
            p.error(f"--replot: no {summary}; pass as --out the folder of a finished run "
                    "(one of benchmarks/results/*)")
        with open(summary) as f:
            old = json.load(f)
        a = p.parse_args([*shlex.split(old["command"])[2:], "--out", a.out,
                          "--results-md", a.results_md, "--replot"])
    if a.quick:
        a.preset, a.steps, a.eval_every = "tiny", 48, 8
    t_start = time.time()
    load_start = os.getloadavg()
    if a.replot:
        all_runs, network_of = _load_runs(a.out, _profile_names(a))
        a.steps = next(runs[a.baseline]["config"]["steps"] for reps in all_runs.values()
                       for runs in reps if a.baseline in runs)
        a.repeats = len(next(iter(all_runs.values())))
        a.elapsed_s = old["elapsed_s"]  # the training run's, not the replot's
        a.loadavg_end = old["loadavg_end"]
        _write_outputs(a, all_runs, network_of, old["notes"], t_start, old["loadavg_start"],
                       shlex.split(old["command"])[2:])
        return 0

    variants, unavailable = split_available(a.variants)
    notes = [f"variant {u} (not run)" for u in unavailable]
    try:
        a.flags_of = variant_flags(a.variant_args, variants)
    except ValueError as exc:
        p.error(str(exc))
    notes += [f"{v}: its runs add `{' '.join(f)}`" for v, f in a.flags_of.items()]
    ok, why = netns.netns_available()
    profiles = []
    mode_of = {}
    for name in _profile_names(a):
        base, mode_of[name] = uneven.split_profile(name)
        prof = netns.PROFILES[base]
        if mode_of[name]:
            prof = netns.Profile(name, rate_mbit=prof.rate_mbit, delay_ms=prof.delay_ms)
        if prof.shaped and not ok:
            notes.append(f"profile {name} not run: {why}; loopback only")
            continue
        profiles.append(prof)
    if any(p.shaped for p in profiles):
        notes.append("delay: none applied (no netem in this kernel; tc tbf shapes the rate only)")
        netns.cleanup_stale()
    for n in notes:
        print(n, file=sys.stderr)

    os.makedirs(a.out, exist_ok=True)
    common = ["--preset", a.preset, "--period", str(a.period), "--warmup", str(a.warmup),
              "--lr", str(a.lr),
              "--eval-every", str(a.eval_every), "--seed", str(a.seed), "--progress", "off",
              *shlex.split(a.train_args)]
    all_runs: dict[str, list[dict[str, dict]]] = {prof.name: [] for prof in profiles}
    network_of: dict[str, str] = {}
    for rep in range(a.repeats):
        for prof in profiles:
            first = all_runs[prof.name][0] if all_runs[prof.name] else None
            runs = {}
            for v in _rotated(variants, rep, a.baseline):
                run = _run_variant(a, prof, v, rep, runs, first, common, mode_of, notes)
                if run is not None:
                    network_of[prof.name] = run["launch"]["network"]
                    runs[v] = run
            all_runs[prof.name].append({v: runs[v] for v in variants if v in runs})
            saved = [{v: _columnar(dict(r)) for v, r in reps.items()}
                     for reps in all_runs[prof.name]]
            with open(os.path.join(a.out, f"train_{prof.name}.json"), "w") as f:
                # one run: {variant: run}; interleaved repeats: a list of them
                json.dump(saved if a.repeats > 1 else saved[0], f)

    _write_outputs(a, all_runs, network_of, notes, t_start, load_start, argv)
    return 0


def _rotated(variants: list[str], rep: int, baseline: str = "ddp") -> list[str]:
    """The order of repeat ``rep``: the first repeat runs the baseline first (its loss is
    the target the others stop at), every later one the list rotated by ``rep``."""
    if rep == 0:
        return sorted(variants, key=lambda v: v != baseline)
    k = rep % len(variants)
    return variants[k:] + variants[:k]


def _run_variant(a, prof, v: str, rep: int, runs: dict, first: dict | None, common: list,
                 mode_of: dict, notes: list) -> dict | None:
    """One training run of variant ``v`` in repeat ``rep`` (``None`` if it failed)."""
    budget_1x = v in (a.baseline, a.none)
    steps = a.steps if budget_1x else 2 * a.steps
    args = [*common, "--hook", v, "--steps", str(steps)]
    if v in DILOCO_VARIANTS:  # later arguments win
        args += ["--period", str(DILOCO_PERIOD), "--lr", str(a.diloco_lr)]
    if v == HIERARCHICAL:
        args += ["--intra-period", str(a.intra_period),
                 "--ranks-per-node", str(max(1, a.nproc // 2))]
    ddp = (first or runs).get(a.baseline)  # its loss is the same in every repeat
    if not budget_1x and ddp:  # up to 2x budget: stop once past the baseline's loss
        args += ["--stop-at-loss", str(ddp["evals"][-1]["val_loss"]), "--min-steps", str(a.steps)]
    if v in TIMED_VARIANTS:
        args += _timed_args(a, first or runs)
    args += a.flags_of.get(v, [])
    outdir = os.path.join(a.runs_dir, *([f"rep{rep}"] if a.repeats > 1 else []), prof.name, v)
    t0 = time.time()
    quota = uneven.CpuQuota() if uneven.has(mode_of.get(prof.name), "slow-rank") else None
    try:
        with quota or contextlib.nullcontext():
            args += uneven.train_args(mode_of.get(prof.name), quota)
            if prof.shaped:
                with netns.NetnsPair(prof) as pair:
                    run = launch.run_training(args, outdir, pair=pair, nproc=a.nproc,
                                              timeout_s=a.timeout)
            else:
                run = launch.run_training(args, outdir, nproc=a.nproc, timeout_s=a.timeout)
        if mode_of.get(prof.name):
            _note_uneven(notes, prof.name, v, run, quota)
    except launch.LaunchError as exc:  # report it, keep the other variants
        notes.append(f"{prof.name} / {v} (repeat {rep + 1}) FAILED: {str(exc).splitlines()[0]}")
        print(notes[-1], file=sys.stderr, flush=True)
        return None
    s = run["summary"]
    print(f"[{rep + 1}/{a.repeats}] {prof.name:9s} {v:15s} steps={steps:4d} "
          f"val={s['final_val_loss']:.4f} median={s['median_step_s'] * 1e3:7.1f}ms "
          f"mean={s['mean_step_s'] * 1e3:7.1f}ms MB/step={s['bytes_per_step'] / 1e6:6.3f} "
          f"comm={report.comm_wait(s):.0%} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return run


def _profile_names(a) -> list[str]:
    """``--profiles``, plus ``<profile>+<mode>`` for each ``--uneven`` mode."""
    names = a.profiles.split(",")
    if a.uneven:
        names += [f"{n}+{m}" for n in names if "+" not in n for m in a.uneven.split(",")]
    return names


def _timed_args(a, runs: dict) -> list[str]:
    """A time-based variant's flags: round seconds, and the rounds of the step budget."""
    sec = a.round_seconds
    ref = runs["allreduce"]["summary"] if "allreduce" in runs else {}
    if sec is None and (ref.get("handle_stats") or {}).get("rounds"):
        sec = ref["train_s"] / ref["handle_stats"]["rounds"]
    if sec is None and "ddp" in runs:
        sec = a.period * runs["ddp"]["summary"]["mean_step_s"]
    rounds = max(1, 2 * a.steps // a.period)
    out = ["--round-seconds", f"{sec or 1.0:.4f}", "--rounds", str(rounds),
           "--min-rounds", str(max(1, a.steps // a.period)),
           "--eval-every-rounds", str(max(1, round(a.eval_every / a.period)))]
    return out


def _note_uneven(notes: list, prof: str, v: str, run: dict, quota) -> None:
    """Say how the workers were made uneven (once per profile), and each rank's steps."""
    un = run["summary"].get("uneven") or {}
    n0 = len(notes)
    if un.get("jitter_sigma") and not any(n.startswith(f"{prof}: jitter") for n in notes):
        notes.append(f"{prof}: jitter = a sleep after each step's compute, stretching it to "
                     f"compute x max(1, exp({un['jitter_sigma']} z)), z ~ N(0,1) per rank and step")
    if quota is not None:
        where = quota.describe()
        notes.append(f"{prof} / {v}: slow rank {uneven.SLOW_RANK} at 1/{uneven.SLOW_FACTOR} "
                     f"speed by {where}; steps per rank {run['summary'].get('per_rank_steps')}")
    for n in notes[n0:]:
        print(n, file=sys.stderr, flush=True)


def _load_runs(out: str, profiles: list[str]) -> tuple[dict, dict]:
    """Each profile's repeats (a list of ``{variant: run}``) as saved in ``out``."""
    all_runs, network_of = {}, {}
    for name in profiles:
        path = os.path.join(out, f"train_{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            all_runs[name] = saved if isinstance(saved, list) else [saved]
            network_of[name] = next(iter(all_runs[name][0].values()))["launch"]["network"]
    return all_runs, network_of


def _write_outputs(a, all_runs, network_of, notes, t_start, load_start, argv) -> None:
    firsts = {prof: reps[0] for prof, reps in all_runs.items()}  # the first repeat's runs
    first = next(iter(next(iter(firsts.values())).values()))
    cfg = first["config"]
    backend = next((r["config"].get("ops_backend") for runs in firsts.values()
                    for r in runs.values() if r["config"].get("ops_backend")), "n/a")
    repeats = len(next(iter(all_runs.values())))
    header = (f"torch {torch.__version__} | cpu ({os.cpu_count()} cores, {platform.machine()}) | "
              f"world_size {cfg['world_size']} | float32 | {cfg['n_params'] / 1e6:.2f}M-param char "
              f"transformer (d={cfg['d_model']}, layers={cfg['n_layers']}, "
              f"context={cfg['context']}), batch {cfg['batch_size']}/rank | budget {a.steps} "
              f"steps (others up to {2 * a.steps}) | "
              f"period {cfg['period']}, warm-up {cfg['warmup']} | AdamW lr {cfg['lr']:g}"
              f"{_diloco_header(firsts)} | validation every {cfg['eval_every']} steps | "
              f"{repeats} interleaved repeat{'s' if repeats > 1 else ''} | ops backend {backend}")
    per_repeat = {prof: [_with_round_bytes(report.summarize(
        runs, baseline=a.baseline, none=a.none, interpolate=True), runs)
                         for runs in reps] for prof, reps in all_runs.items()}
    rows_by_profile = {prof: report.aggregate(rows) for prof, rows in per_repeat.items()}
    png = report.plot({f"{p}: {network_of[p]}" if p != "loopback" else p: r
                       for p, r in firsts.items()}, os.path.join(a.out, "train.png"),
                      title=header.split(" | ops")[0])
    cmd = "python benchmarks/bench_train.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    elapsed = getattr(a, "elapsed_s", None) or time.time() - t_start
    summary = dict(header=header, command=cmd.strip(), notes=notes, elapsed_s=elapsed,
                   loadavg_start=load_start,
                   loadavg_end=getattr(a, "loadavg_end", None) or os.getloadavg(),
                   networks=network_of, rows=rows_by_profile)
    with open(os.path.join(a.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    md = [f"### {a.title}", "",
          f"Command: `{summary['command']}` ({elapsed / 60:.1f} min; load average "
          f"{load_start[0]:.1f} at start, {summary['loadavg_end'][0]:.1f} at end: the 2 cores are "
          "shared, so absolute times vary between runs; compare within a table).", "",
          f"`{header}`", ""]
    md += [f"- {n}" for n in notes]
    if (a.baseline, a.none) != ("ddp", "none"):
        md += [f"- the baseline (DDP's role in the definitions and targets below) is "
               f"`{a.baseline}`; the variant that never communicates (`none`'s) is `{a.none}`"]
    md += ["", "Definitions: target = DDP's validation loss at the end of its budget; time to "
           "target and steps to target = training wall-clock (validation excluded, but not the "
           "wait for the other ranks as it begins) and steps, interpolated between the two "
           "validations around the target, 'not reached' within twice the budget otherwise; "
           "the limit = DDP's steps to its own loss times `none`'s mean step in the same repeat, "
           "x of limit = time to target over it = steps x (steps to target over DDP's) times "
           "step time x (mean step up to the target over `none`'s); x sooner than a peer = the "
           "peer's time to target over the row's, in the same repeat; with repeats, each cell "
           "is the median over the repeats, with their min-max in brackets; validation is of "
           "the ranks' average "
           "model; MB/step = bytes rank 0 handed to collectives per step (wire MB/step: the veth "
           "device's kernel counter, TCP/IP overhead included); comm wait = share of step time "
           "waiting on communication (gradient all-reduces, and the averaging call of every step: "
           "its rounds, their deferred phases and late write-backs; not the wait for the other "
           "ranks as a validation begins, which is idle time of uneven ranks, in the training time "
           "and the idle share); local step / none = median step that sent nothing over "
           "the median step of `none`; MB to target = bytes rank 0 handed to collectives up to the "
           "first validation at or below the target. Plot: `benchmarks/results/train.png`.", ""]
    for prof, rows in rows_by_profile.items():
        md += [f"#### {prof}: {network_of[prof]}", "",
               report.markdown_table(rows, report.REPEAT_COLUMNS), ""]
        md += _breakdown(rows, all_runs[prof], prof, a.none)
        md += _memory(rows)
        if "+" in prof:  # uneven workers: per-rank steps, compute and idle time
            md += ["Uneven workers: compute = step time minus time waiting on communication "
                   "(gradient-sync waits, averaging rounds, the wait for the other ranks as a "
                   "validation begins); overhead = (mean step - mean "
                   "compute) / mean compute; idle share = each rank's waiting time over its "
                   "training time (rank 0 / rank 1 ...).", "",
                   report.markdown_table(uneven.rows(firsts[prof]), uneven.COLUMNS), ""]
        md += _targets(rows, prof)
        md += _limit_targets(rows, per_repeat[prof], prof)
        md += _sharded_targets(rows, len(per_repeat[prof]), prof)
    with open(os.path.join(a.out, "train_section.md"), "w") as f:
        f.write("\n".join(md))
    # the section: this run's part plus the parts other invocations left under results/
    parts = sorted(glob.glob(os.path.join(RESULTS, "**", "train_section.md"), recursive=True),
                   key=lambda q: (os.path.dirname(q) != RESULTS, q))
    if os.path.join(os.path.abspath(a.out), "train_section.md") not in map(os.path.abspath, parts):
        parts.append(os.path.join(a.out, "train_section.md"))
    body = []
    for q in parts:
        with open(q) as f:
            body += [f.read().strip(), ""]
    body += _two_node_record(os.path.join(RESULTS, "two_node.json"))
    report.write_section(a.results_md, "\n".join(body))
    print("\n".join(md))
    print(f"plot: {png}; results: {a.out}; table: {a.results_md}", file=sys.stderr)


def _with_round_bytes(rows: list[dict], runs: dict) -> list[dict]:
    """Add the handles' own byte counts: the global rounds, and (hierarchical) the node rounds."""
    for row in rows:
        stats = runs[row["variant"]]["summary"].get("handle_stats") or {}
        if "bytes_sent" in stats:
            row["global_round_mb"] = stats["bytes_sent"] / 1e6
        if "node" in stats:
            row["node_round_mb"] = stats["node"]["bytes_sent"] / 1e6
    return rows


def _ours(variant: str) -> bool:
    spec = VARIANT_SPECS.get(variant)
    return spec is not None and spec.ours


def _best_ours(rows: list[dict]) -> dict | None:
    """Our variant with the smallest median time to target."""
    reached = [r for r in rows if _ours(r["variant"]) and r.get("time_to_target_s")]
    return min(reached, key=lambda r: r["time_to_target_s"]) if reached else None


def _breakdown(rows: list[dict], reps: list[dict], prof: str, none: str = "none") -> list[str]:
    """Where a step's time goes, for ``none``, PyTorch's local SGD and our best: medians
    over the repeats of each part's mean per step."""
    import statistics

    best = _best_ours(rows)
    names = [v for v in (none, "torch_localsgd") if v in reps[0]]
    names += [best["variant"]] if best else []
    out = []
    for v in names:
        parts = [runs[v]["summary"].get("breakdown") for runs in reps if v in runs]
        parts = [p for p in parts if p]
        if not parts:
            continue
        med = {k: statistics.median(p[k] for p in parts) * 1e3 for k in parts[0]}
        out.append(dict(variant=v, mean_step_ms=statistics.median(
            runs[v]["summary"]["mean_step_s"] for runs in reps if v in runs) * 1e3,
            fwd_bwd_ms=med.get("fwd_bwd_s"), grad_wait_ms=med.get("grad_wait_s"),
            opt_ms=med.get("opt_s"), avg_ms=med.get("avg_s"),
            round_wait_ms=med.get("round_wait_s"), other_cpu_ms=med.get("other_cpu_s")))
    if not out:
        return []
    columns, waiting = report.BREAKDOWN_COLUMNS, ""
    if any(r["round_wait_ms"] is not None for r in out):
        waiting = ("waiting for rounds = the part of our averaging call spent waiting for "
                   "rounds' results, the rest of it is the training thread's own work on the "
                   "rounds; ")
    else:  # recorded before the averaging call was split
        columns = [c for c in columns if c[1] != "round_wait_ms"]
    return [f"Where a step's time goes ({prof}; mean per step, median over the repeats; "
            f"{waiting}other threads' CPU = CPU time of the process's other threads during the "
            "step: gloo's and the rounds' background work, on the same shared cores):", "",
            report.markdown_table(out, columns), ""]


def _memory(rows: list[dict]) -> list[str]:
    """Memory per rank, for the runs of sharded models (whose ranks hold parts)."""
    if not any(VARIANT_SPECS.get(r["variant"]) and VARIANT_SPECS[r["variant"]].fsdp
               for r in rows):
        return []
    return ["Memory per rank (parameters held = this rank's local shards; registration "
            "holds = the bytes the averaging registration holds, `handle.memory_bytes()`, over "
            "them; peak RSS = the process's peak resident set, the largest over the ranks, "
            "median over the repeats):", "",
            report.markdown_table(rows, report.MEMORY_COLUMNS), ""]


def _met(values, ok) -> tuple[int, int]:
    present = [v for v in values if v is not None]
    return sum(ok(v) for v in present), len(present)


def _shown(x: float, ok, percent: bool = False) -> str:
    """``x`` to 2 decimals (a percentage: to 1), or to one more where rounding would put it
    on the other side of ``ok``.

    >>> _shown(1.0534, lambda v: v <= 1.05), _shown(1.0449, lambda v: v <= 1.05)
    ('1.053', '1.04')
    >>> _shown(0.02049, lambda v: v <= 0.02, percent=True)
    '2.05%'
    """
    digits = 1 if percent else 2
    if ok(round(x, digits + 2 * percent)) != ok(x):
        digits += 1
    return f"{x:.{digits}%}" if percent else f"{x:.{digits}f}"


def _judged(row: dict, what: str, key: str, ok, goal: str, n: int) -> str:
    """``row[key]`` (a median over ``n`` repeats) judged by ``ok``: met or not, in how many
    repeats, and whether the spread straddles the goal."""
    v, values = row.get(key), row.get(f"{key}_values") or [row.get(key)]
    if v is None:
        return f"- {what}: n/a ({goal})."
    k, m = _met(values, ok)
    lo, hi = row.get(f"{key}_range") or (v, v)
    straddle = " (the spread straddles it)" if ok(lo) != ok(hi) else ""
    return (f"- {what}: median {_shown(v, ok)}, {_shown(lo, ok)}-{_shown(hi, ok)} over {n} "
            f"repeats ({goal}: "
            f"{'met' if ok(v) else 'not met'}, met in {k} of {m}{straddle}).")


def _sharded_targets(rows: list[dict], n: int, prof: str) -> list[str]:
    """The targets of sharded replicas against native HSDP (the runs' baseline): time to
    its loss, bytes across the link (int8), torchft's DiLoCo at the same period, memory."""
    by = {r["variant"]: r for r in rows}
    ours = [r for r in rows if _ours(r["variant"]) and VARIANT_SPECS[r["variant"]].fsdp]
    if not ours:
        return []
    out = [f"Targets of sharded replicas ({prof}), against native HSDP:"]
    for r in ours:
        out.append(_judged(r, f"`{r['variant']}` x sooner than native HSDP",
                           "ttt_speedup_vs_ddp", lambda x: x >= 2.0, "target >= 2x", n))
    for r in ours:
        if "int8" in (VARIANT_SPECS[r["variant"]].hook or ""):
            out.append(_judged(r, f"`{r['variant']}` x fewer bytes across the link to HSDP's "
                               "loss", "bytes_saving_vs_ddp", lambda x: x >= 8.0,
                               "target >= 8x", n))
    if "fsdp_diloco" in by:
        out.append(_judged(by["fsdp_diloco"], "`fsdp_diloco` x sooner than torchft's DiLoCo "
                           "on the same FSDP2 model, same period", "vs_torchft",
                           lambda x: x > 1.0, "target: ahead", n))
    if "fsdp_allreduce" in by:
        out.append(_judged(by["fsdp_allreduce"], "`fsdp_allreduce` (exact) registration holds "
                           "x the local shard", "held_x", lambda x: x <= 1.05,
                           "target <= 1.05x", n))
    return out + [""]


def _limit_targets(rows: list[dict], per_repeat: list[list[dict]], prof: str) -> list[str]:
    """The targets judged on the medians, with in how many repeats each was met; a spread
    that straddles a target is said so."""
    best = _best_ours(rows)
    if best is None:
        return []
    n = len(per_repeat)
    out = []

    def line(what, key, ok, goal):
        return _judged(best, what, key, ok, goal, n)

    limit = report.LIMIT_TARGETS.get(prof.split("+")[0])
    out.append(f"Targets of interleaved repeats ({prof}), for our best configuration "
               f"`{best['variant']}`:")
    if limit:
        out.append(line("time to target over the no-communication limit", "x_of_limit",
                        lambda x: x <= limit, f"target <= {limit}x"))
    out.append(line("steps to DDP's loss over DDP's", "steps_x",
                    lambda x: x <= report.STEPS_TARGET,
                    f"target <= {report.STEPS_TARGET:.2f}x"))
    for key, peer in (("vs_pma", "PeriodicModelAverager"), ("vs_powersgd", "DDP + PowerSGD"),
                      ("vs_torchft", "torchft's DiLoCo")):
        if best.get(f"{key}_values") and any(x is not None for x in best[f"{key}_values"]):
            out.append(line(f"x sooner than {peer}", key, lambda x: x > 1.0,
                            "target: ahead in every repeat"))
    within = (lambda x: x <= 0.02)
    for r in rows:
        spec = VARIANT_SPECS.get(r["variant"])
        if spec is not None and spec.ours and spec.overlap and r.get("comm_share") is not None:
            k, m = _met(r.get("comm_share_values") or [], within)
            out.append(f"- comm wait of `{r['variant']}` (overlapped): median "
                       f"{_shown(r['comm_share'], within, percent=True)} (target <= 2%: "
                       f"{'met' if within(r['comm_share']) else 'not met'}, met in {k} of {m}).")
    local = [r for r in rows if _ours(r["variant"]) and r.get("local_overhead")]
    if local:
        worst = max(local, key=lambda r: r["local_overhead"])
        x, ok = worst["local_overhead"], (lambda v: v <= 1.05)
        out.append(f"- local step over `none`'s: at most {_shown(x, ok)} (median, "
                   f"`{worst['variant']}`; target <= 1.05x: {'met' if ok(x) else 'not met'}).")
    return out + [""]


def _diloco_header(all_runs: dict) -> str:
    dl = next((r["config"] for runs in all_runs.values() for v, r in runs.items()
               if v in DILOCO_VARIANTS), None)
    if dl is None:
        return ""
    return (f" (DiLoCo: inner lr {dl['lr']:g}, period {dl['period']}, outer Nesterov SGD "
            f"lr {dl['outer_lr']:g}, momentum {dl['outer_momentum']:g})")


def _two_node_record(path: str) -> list[str]:
    """The recorded ``harness.launch`` run of two torchrun nodes, if any."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rec = json.load(f)
    o = rec["outcome"]
    md = ["### Two torchrun nodes in two network namespaces", "",
          f"`PYTHONPATH=benchmarks python -m harness.launch --profile 100mbit --record "
          f"benchmarks/results/two_node.json -- {' '.join(rec['train_args'])}` ran, on "
          f"{rec['network']}:", "", "```"]
    md += [c.replace(os.getcwd() + "/", "") for c in rec.get("commands") or []]
    md += ["```", ""]
    if o.get("ok"):
        md.append(f"Outcome: world_size {o['world_size']}, final validation loss "
                  f"{o['final_val_loss']:.3f}, median step {o['median_step_s'] * 1e3:.0f} ms, "
                  f"{o['bytes_per_step'] / 1e6:.3f} MB/step handed to collectives, "
                  f"{(o.get('wire_bytes_per_step') or 0) / 1e6:.3f} MB/step on the veth "
                  f"(kernel counter), {o['wall_s']:.0f} s including start-up.")
    else:
        md.append(f"Outcome: failed: {o.get('error')}")
    return md + [""]


def _targets(rows: list[dict], prof: str) -> list[str]:
    """The targets, checked against this run's numbers (reported, not asserted)."""
    lines = [*_speed_targets(rows, prof), *_overlap_diloco_targets(rows, prof)]
    return [*lines, ""] if lines else []


def _speed_targets(rows: list[dict], prof: str) -> list[str]:
    """Our best hook against DDP and PyTorch's local SGD; the loss at equal samples."""
    ours = [r for r in rows if r["variant"] in ("allreduce", "fp16", "bf16", "powersgd")]
    reached = [r for r in ours if r.get("time_to_target_s")]
    if not ours:
        return []
    if not reached:
        return [f"Targets ({prof}): none of our hooks reached DDP's loss within twice its budget."]
    best = min(reached, key=lambda r: r["time_to_target_s"])
    vs_ddp, vs_torch = best.get("ttt_speedup_vs_ddp"), best.get("ttt_speedup_vs_torch")
    gap = best.get("gap_pct")
    f = lambda v, s: "n/a" if v is None else format(v, s)  # noqa: E731
    if vs_torch is not None:
        torch_part = (f"{vs_torch:.2f}x sooner than PyTorch's PeriodicModelAverager (target >= "
                      f"1.5x: {'met' if vs_torch >= 1.5 else 'not met'})")
    elif any(r["variant"] == "torch_localsgd" for r in rows):
        torch_part = "PyTorch's PeriodicModelAverager did not reach it (target >= 1.5x: n/a)"
    else:
        torch_part = "PyTorch's PeriodicModelAverager not in this run (target >= 1.5x: n/a)"
    line = (f"Targets ({prof}): best hook `{best['variant']}` reaches the target "
            f"{f(vs_ddp, '.2f')}x sooner than DDP (target >= 4x: "
            f"{'met' if vs_ddp and vs_ddp >= 4 else 'not met'}), {torch_part}; "
            f"loss at equal samples {f(gap, '+.1f')}% vs DDP (target within 2%: "
            f"{'met' if gap is not None and abs(gap) <= 2 else 'not met'}).")
    return [line]


def _fewest_bytes_candidate(variant: str) -> bool:
    """The variants the 100x bytes target is about: the DiLoCo family, 4-bit, fragments."""
    spec = VARIANT_SPECS.get(variant)
    if spec is None:
        return False
    return (variant in DILOCO_VARIANTS or spec.inner_hook is not None or spec.fragments
            or "int4" in (spec.hook or ""))


def _overlap_diloco_targets(rows: list[dict], prof: str) -> list[str]:
    """Targets of overlap and DiLoCo: overlapped steps within 15% of ``none``'s; DiLoCo >= 16x
    fewer bytes; the fewest bytes to DDP's target of the DiLoCo family, 4-bit and fragment
    variants, >= 100x fewer."""
    by = {r["variant"]: r for r in rows}
    out = []
    none = by.get("none")
    for v in ("allreduce_overlap", "fp16_overlap"):
        if v in by and none:
            ratio = by[v]["mean_step_ms"] / none["mean_step_ms"]
            out.append(f"- Overlap ({prof}): `{v}` mean step {ratio:.2f}x the no-communication "
                       f"step (target <= 1.15x: {'met' if ratio <= 1.15 else 'not met'}).")
    for v in sorted(DILOCO_VARIANTS & by.keys()):
        saving = by[v].get("bytes_saving_vs_ddp")
        verdict = ("not reached within twice DDP's budget: not met" if saving is None
                   else f"{saving:.1f}x fewer bytes than DDP to DDP's target loss "
                        f"(target >= 16x: {'met' if saving >= 16 else 'not met'})")
        out.append(f"- DiLoCo ({prof}): `{v}` {verdict}.")
    savings = {v: r["bytes_saving_vs_ddp"] for v, r in by.items()
               if _fewest_bytes_candidate(v) and r.get("bytes_saving_vs_ddp")}
    if savings:
        best = max(savings, key=savings.get)
        out.append(f"- Bytes to DDP's target ({prof}): fewest with `{best}`, {savings[best]:.1f}x "
                   f"fewer than DDP (target >= 100x: "
                   f"{'met' if savings[best] >= 100 else 'not met'}).")
    flat, hier = by.get("allreduce"), by.get(HIERARCHICAL)
    if flat and hier:
        f = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
        out.append(
            f"- Hierarchical ({prof}): loss at DDP's budget {f(hier.get('val_at_budget'), '.3f')} "
            f"vs {f(flat.get('val_at_budget'), '.3f')} for flat `allreduce` at the same global "
            f"period; time to target {f(hier.get('time_to_target_s'), '.1f')} s vs "
            f"{f(flat.get('time_to_target_s'), '.1f')} s; wire MB/step (what crosses the "
            f"nodes' link) {f(hier.get('wire_mb_per_step'), '.3f')} vs "
            f"{f(flat.get('wire_mb_per_step'), '.3f')}; bytes of the global rounds over the run "
            f"(each stops at the target) {f(hier.get('global_round_mb'), '.1f')} MB "
            f"vs {f(flat.get('global_round_mb'), '.1f')} MB, plus "
            f"{f(hier.get('node_round_mb'), '.1f')} MB of node rounds that stay inside the nodes "
            "(counted in its MB/step and MB to target).")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
