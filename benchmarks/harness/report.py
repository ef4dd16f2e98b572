"""Turn training runs (``metrics.json`` of :mod:`.train`) into tables, plots and RESULTS.md.

Definitions (used by ``make demo`` and ``benchmarks/bench_train.py``):

- *target loss*: the baseline's (DDP's) validation loss at the end of its step budget;
- *time to target*: training wall-clock (rank 0, validation excluded) at the first
  validation point whose loss is <= the target; ``None`` ("not reached") otherwise;
  ``bench_train.py`` and ``make demo`` interpolate between that point and the one before
  it (``interpolate=True``), and count *steps to target* likewise;
- *equal time* (``make demo``, :func:`summarize_equal_time`): every run trains for the
  baseline's training time; its loss at equal time is its final validation loss;
- *MB to target*: bytes rank 0 handed to collectives up to that same validation point;
  *x fewer bytes than DDP*: the baseline's MB to target over the run's;
- *loss at equal samples*: validation loss at the baseline's last step, and its gap to
  the baseline in percent;
- *MB/step*: bytes rank 0 handed to collectives, averaged over all steps;
- *comm wait share*: seconds waiting on communication (gradient all-reduces and every
  step's averaging call) / training seconds (:func:`comm_wait`);
- *local-step overhead*: median step time of steps that neither averaged nor sent
  anything, over the median step of the no-communication run (``none``);
- *the no-communication limit*: DDP's steps to its own final loss times ``none``'s mean
  step: the time to DDP's loss of a method that needs DDP's steps and sends nothing; *x
  of limit*: a run's time to target over it, the product of *steps x* (its steps to the
  target over DDP's) and *step time x* (its mean step up to the target over ``none``'s).

Example::

    >>> run = {"config": {"steps": 4, "hook": "x"}, "summary": {"train_s": 2.0},
    ...        "evals": [{"step": 2, "train_s": 1.0, "bytes": 0, "val_loss": 3.0},
    ...                  {"step": 4, "train_s": 2.0, "bytes": 0, "val_loss": 2.0}]}
    >>> time_to_target(run, 2.5), time_to_target(run, 1.0), loss_at_step(run, 2)
    (2.0, None, 3.0)
    >>> time_to_target(run, 2.5, interpolate=True)
    1.5
    >>> bytes_to_target(run, 2.5), bytes_to_target(run, 1.0)
    (0, None)
"""
from __future__ import annotations

import os
import re

SECTION = "## End-to-end training"
# the shaped links' targets for our best configuration's time to target over the limit
LIMIT_TARGETS = {"100mbit": 1.15, "25mbit": 1.3}
# the target for steps to DDP's loss over DDP's steps, on every link
STEPS_TARGET = 1.10


def _steps(run: dict) -> int:
    return run["config"].get("steps_done", run["config"]["steps"])


def _first_at_target(run: dict, target: float) -> dict | None:
    return next((e for e in run["evals"] if e["val_loss"] <= target), None)


def _at_target(run: dict, target: float, key: str, interpolate: bool) -> float | None:
    """``key`` of the first validation at or below ``target``, or linearly between it and
    the validation before it; ``None`` if no validation reached it."""
    evals = run["evals"]
    k = next((k for k, e in enumerate(evals) if e["val_loss"] <= target), None)
    if k is None:
        return None
    hit = evals[k]
    if not interpolate or k == 0:
        return hit[key]
    prev = evals[k - 1]
    frac = (prev["val_loss"] - target) / (prev["val_loss"] - hit["val_loss"])
    return prev[key] + frac * (hit[key] - prev[key])


def time_to_target(run: dict, target: float, interpolate: bool = False) -> float | None:
    """Training seconds at the first validation at or below ``target`` (``None``: never).

    ``interpolate``: linearly between that validation and the one before it (which was
    above the target), instead of that validation's own time.
    """
    return _at_target(run, target, "train_s", interpolate)


def steps_to_target(run: dict, target: float, interpolate: bool = False) -> float | None:
    """Steps at the first validation at or below ``target`` (``None``: never), or with
    ``interpolate`` linearly between it and the validation before it.

    >>> run = {"evals": [{"step": 20, "train_s": 1.0, "val_loss": 3.0},
    ...                  {"step": 40, "train_s": 2.0, "val_loss": 2.0}]}
    >>> steps_to_target(run, 2.5), steps_to_target(run, 2.5, interpolate=True)
    (40, 30.0)
    """
    return _at_target(run, target, "step", interpolate)


def bytes_to_target(run: dict, target: float) -> int | None:
    hit = _first_at_target(run, target)
    return None if hit is None else hit["bytes"]


def loss_at_step(run: dict, step: int) -> float | None:
    for e in run["evals"]:
        if e["step"] == step:
            return e["val_loss"]
    return None


def comm_wait(summary: dict) -> float:
    """Share of rank 0's training time spent waiting on communication: the run's waits
    less the wait for the other ranks as a validation begins (that one is idle time of
    uneven ranks, counted in their idle share, not communication).

    >>> comm_wait(dict(comm_share=0.25, val_wait_s=1.0, train_s=10.0))
    0.15
    """
    waited = summary.get("val_wait_s") or 0.0
    return summary["comm_share"] - (waited / max(summary["train_s"], 1e-12) if waited else 0.0)


#: the peers ``vs_<key>`` compares with: the first of the variants that ran
PEERS = {"pma": ("torch_localsgd",), "powersgd": ("ddp_powersgd",),
         "torchft": ("torchft_diloco", "torchft_fsdp_diloco")}


def summarize(runs: dict[str, dict], baseline: str = "ddp", none: str = "none",
              reference: str = "torch_localsgd", interpolate: bool = False) -> list[dict]:
    """One row per run (in ``runs`` order) with the metrics defined in the module docstring.

    ``interpolate``: times and steps to the target between the two validations around
    it. Then each row also has ``steps_to_target``, ``vs_<peer>`` (the peer's time to
    target over the run's: ``pma``, ``powersgd``, ``torchft``; ``None`` without it),
    ``x_of_limit`` (the run's time to target over the no-communication limit: DDP's steps
    to its own loss times ``none``'s mean step), and its two factors, ``steps_x`` (steps
    to target over DDP's) and ``step_time_x`` (mean step up to the target over ``none``'s).
    """
    base = runs.get(baseline)
    budget = _steps(base) if base else None
    target = base["evals"][-1]["val_loss"] if base else None
    base_ttt = time_to_target(base, target, interpolate) if base else None
    ref_ttt = time_to_target(runs[reference], target, interpolate) \
        if reference in runs and base else None
    base_btt = bytes_to_target(base, target) if base else None
    none_step = runs[none]["summary"]["median_step_s"] if none in runs else None
    base_step = base["summary"]["mean_step_s"] if base else None
    base_steps = steps_to_target(base, target, interpolate) if base else None
    none_mean = runs[none]["summary"]["mean_step_s"] if none in runs else None
    limit = base_steps * none_mean if base_steps and none_mean else None
    peer_of = {k: next((v for v in names if v in runs), None) for k, names in PEERS.items()}
    peer_ttt = {k: time_to_target(runs[v], target, interpolate) if v and base else None
                for k, v in peer_of.items()}
    rows = []
    for name, run in runs.items():
        s = run["summary"]
        row = dict(variant=name, steps=_steps(run),
                   final_val_loss=run["evals"][-1]["val_loss"],
                   median_step_ms=s["median_step_s"] * 1e3, mean_step_ms=s["mean_step_s"] * 1e3,
                   mb_per_step=s["bytes_per_step"] / 1e6,
                   wire_mb_per_step=(s.get("wire_bytes_per_step") or 0) / 1e6
                   if s.get("wire_bytes_per_step") is not None else None,
                   comm_share=comm_wait(s),
                   speedup=(base_step / s["mean_step_s"]) if base_step else None)
        rss, held = s.get("per_rank_peak_rss_mb"), (s.get("handle_stats") or {}).get("memory_bytes")
        row["peak_rss_mb"] = max(rss) if rss else None
        row["param_mb"] = s["param_bytes"] / 2**20 if s.get("param_bytes") else None
        row["held_x"] = held / s["param_bytes"] if held is not None and s.get("param_bytes") \
            else None
        local = s.get("median_local_step_s")
        row["local_overhead"] = ((local / none_step) if local and none_step and name != none
                                 else None)
        if base is not None:
            at = loss_at_step(run, budget)
            row["val_at_budget"] = at
            row["gap_pct"] = None if at is None else 100.0 * (at - target) / target
            ttt = time_to_target(run, target, interpolate) if name != none else None
            row["time_to_target_s"] = ttt
            row["ttt_speedup_vs_ddp"] = base_ttt / ttt if ttt and base_ttt else None
            row["ttt_speedup_vs_torch"] = ref_ttt / ttt if ttt and ref_ttt else None
            btt = bytes_to_target(run, target) if name != none else None
            row["mb_to_target"] = None if btt is None else btt / 1e6
            row["bytes_saving_vs_ddp"] = base_btt / btt if btt and base_btt else None
            if interpolate:
                stt = steps_to_target(run, target, True) if name != none else None
                row["steps_to_target"] = stt
                row["limit_s"] = limit
                row["x_of_limit"] = ttt / limit if ttt and limit else None
                row["steps_x"] = stt / base_steps if stt and base_steps else None
                row["step_time_x"] = (ttt / stt) / none_mean if ttt and stt and none_mean else None
                for key, peer_t in peer_ttt.items():
                    row[f"vs_{key}"] = peer_t / ttt if ttt and peer_t and \
                        name != peer_of[key] else None
        row["breakdown"] = s.get("breakdown")
        rows.append(row)
    return rows


RANGED = ("steps", "median_step_ms", "mean_step_ms", "comm_share", "local_overhead",
          "time_to_target_s", "steps_to_target", "ttt_speedup_vs_ddp", "ttt_speedup_vs_torch",
          "x_of_limit", "steps_x", "step_time_x", "vs_pma", "vs_powersgd", "vs_torchft",
          "limit_s", "mb_to_target", "bytes_saving_vs_ddp", "val_at_budget", "gap_pct",
          "final_val_loss", "peak_rss_mb", "held_x")


def aggregate(rows_per_repeat: list[list[dict]], keys: tuple = RANGED) -> list[dict]:
    """One row per variant over interleaved repeats: each metric of ``keys`` (by default
    :data:`RANGED`) as its median over the repeats that have it, with ``<metric>_range``
    = (min, max) and ``<metric>_values`` (one per repeat, ``None`` where missing);
    ``repeats`` counts them.
    Other keys come from the first repeat that has the variant. Variants keep the
    repeats' order; a variant whose run failed in the first repeat keeps its row, in
    its place.

    >>> r = lambda t: [{"variant": "a", "time_to_target_s": t}]
    >>> row = aggregate([r(3.0), r(1.0), r(2.0)])[0]
    >>> row["time_to_target_s"], row["time_to_target_s_range"], row["repeats"]
    (2.0, (1.0, 3.0), 3)
    >>> [(x["variant"], x["repeats"]) for x in aggregate([[{"variant": "b"}],
    ...                                                 [{"variant": "a"}, {"variant": "b"}]])]
    [('a', 1), ('b', 2)]
    """
    import statistics

    order: list[str] = []
    for rows in rows_per_repeat:  # merged: each new variant goes after its predecessor
        prev = None
        for r in rows:
            v = r["variant"]
            if v not in order:
                order.insert(order.index(prev) + 1 if prev is not None else 0, v)
            prev = v
    by_variant = {v: [next((r for r in rows if r["variant"] == v), None)
                      for rows in rows_per_repeat] for v in order}
    out = []
    for v, rows in by_variant.items():
        first = next(r for r in rows if r is not None)
        row = dict(first, repeats=sum(r is not None for r in rows))
        for key in keys:
            values = [None if r is None else r.get(key) for r in rows]
            present = [x for x in values if x is not None]
            row[key] = statistics.median(present) if present else None
            row[f"{key}_range"] = (min(present), max(present)) if present else None
            row[f"{key}_values"] = values
        out.append(row)
    return out


def summarize_equal_time(runs: dict[str, dict], baseline: str = "ddp") -> list[dict]:
    """``make demo``'s rows: every run had the baseline's training time (``--time-budget``).

    Per run (in ``runs`` order): ``steps`` done, ``train_s`` (its training clock at the
    end), ``val_at_equal_time`` (its final validation, at the end of the budget) and
    ``gap_pct`` against the baseline's, ``time_to_target_s`` (interpolated time to the
    baseline's final validation loss; ``None``: not reached), ``speedup`` (the baseline's
    time to that loss over the run's), ``mean_step_ms`` and ``mb_per_step``.
    Without the baseline only the per-run columns are filled.

    >>> ev = lambda *pts: [{"step": i, "train_s": t, "bytes": 0, "val_loss": v}
    ...                    for i, (t, v) in enumerate(pts, 1)]
    >>> runs = {"ddp": {"config": {"steps": 2}, "evals": ev((1.0, 3.0), (2.0, 2.0)),
    ...                 "summary": {"train_s": 2.0, "mean_step_s": 1.0, "bytes_per_step": 4e6}},
    ...         "ls": {"config": {"steps": 8}, "evals": ev((0.5, 2.5), (1.0, 1.5), (2.0, 1.2)),
    ...                "summary": {"train_s": 2.0, "mean_step_s": 0.25, "bytes_per_step": 1e6}}}
    >>> [(r["variant"], r["time_to_target_s"], r["speedup"]) for r in summarize_equal_time(runs)]
    [('ddp', 2.0, 1.0), ('ls', 0.75, 2.6666666666666665)]
    """
    base = runs.get(baseline)
    target = base["evals"][-1]["val_loss"] if base else None
    base_ttt = time_to_target(base, target, interpolate=True) if base else None
    rows = []
    for name, run in runs.items():
        s = run["summary"]
        final = run["evals"][-1]["val_loss"]
        ttt = time_to_target(run, target, interpolate=True) if base else None
        row = dict(variant=name, steps=_steps(run), train_s=s["train_s"],
                   val_at_equal_time=final, mean_step_ms=s["mean_step_s"] * 1e3,
                   mb_per_step=s["bytes_per_step"] / 1e6, stopped_by=s.get("stopped_by"))
        if base is not None:
            row.update(gap_pct=100.0 * (final - target) / target, time_to_target_s=ttt,
                       speedup=base_ttt / ttt if ttt and base_ttt else None)
        rows.append(row)
    return rows


def _fmt(v, spec: str) -> str:
    if v is None:
        return "n/a"
    return format(v, spec)


DEMO_COLUMNS = [("variant", "variant", "s"), ("steps", "steps", "d"),
                ("train s", "train_s", ".1f"),
                ("val loss @ equal time", "val_at_equal_time", ".3f"),
                ("gap vs DDP", "gap_pct", "+.1f"),
                ("time to DDP's loss s", "time_to_target_s", ".1f"),
                ("speedup vs DDP", "speedup", ".2f"),
                ("time/step ms", "mean_step_ms", ".1f"), ("MB/step", "mb_per_step", ".3f")]

#: the columns of interleaved repeats (medians, with min-max over the repeats)
REPEAT_COLUMNS = [("variant", "variant", "s"), ("steps", "steps", ".0f"),
                  ("mean step ms", "mean_step_ms", ".1f"), ("MB/step", "mb_per_step", ".3f"),
                  ("comm wait", "comm_share", ".0%"),
                  ("local step / none", "local_overhead", ".2f"),
                  ("steps to target", "steps_to_target", ".0f"),
                  ("time to target s", "time_to_target_s", ".1f"),
                  ("x of limit", "x_of_limit", ".2f"), ("= steps x", "steps_x", ".2f"),
                  ("x step time", "step_time_x", ".2f"),
                  ("x sooner than PMA", "vs_pma", ".2f"),
                  ("x sooner than DDP+PowerSGD", "vs_powersgd", ".2f"),
                  ("x sooner than torchft DiLoCo", "vs_torchft", ".2f"),
                  ("x fewer bytes than DDP", "bytes_saving_vs_ddp", ".1f")]

BREAKDOWN_COLUMNS = [("variant", "variant", "s"), ("step ms", "mean_step_ms", ".1f"),
                     ("forward+backward ms", "fwd_bwd_ms", ".1f"),
                     ("of which gradient-sync wait ms", "grad_wait_ms", ".1f"),
                     ("optimizer ms", "opt_ms", ".1f"), ("averaging call ms", "avg_ms", ".1f"),
                     ("of which waiting for rounds ms", "round_wait_ms", ".2f"),
                     ("other threads' CPU ms", "other_cpu_ms", ".1f")]

#: memory per rank: the parameters it holds, what the averaging registration holds over
#: them, the process's peak resident set
MEMORY_COLUMNS = [("variant", "variant", "s"), ("parameters held MB", "param_mb", ".2f"),
                  ("registration holds x", "held_x", ".2f"),
                  ("peak RSS MB (max over ranks)", "peak_rss_mb", ".0f")]

BENCH_COLUMNS = [("variant", "variant", "s"), ("steps", "steps", "d"),
                 ("median step ms", "median_step_ms", ".1f"),
                 ("mean step ms", "mean_step_ms", ".1f"),
                 ("MB/step", "mb_per_step", ".3f"), ("wire MB/step", "wire_mb_per_step", ".3f"),
                 ("comm wait", "comm_share", ".0%"), ("local step / none", "local_overhead", ".2f"),
                 ("val loss @ DDP budget", "val_at_budget", ".3f"),
                 ("gap vs DDP", "gap_pct", "+.1f"),
                 ("time to target s", "time_to_target_s", ".1f"),
                 ("x faster than DDP", "ttt_speedup_vs_ddp", ".2f"),
                 ("x faster than torch local SGD", "ttt_speedup_vs_torch", ".2f"),
                 ("MB to target", "mb_to_target", ".1f"),
                 ("x fewer bytes than DDP", "bytes_saving_vs_ddp", ".1f")]


def markdown_table(rows: list[dict], columns=DEMO_COLUMNS) -> str:
    """A GitHub-flavoured markdown table; ``None`` prints as ``n/a``.

    >>> cols = [("variant", "variant", "s"), ("time to target s", "time_to_target_s", ".1f"),
    ...         ("MB/step", "mb_per_step", ".3f")]
    >>> rows = [{"variant": "ddp", "time_to_target_s": 2.0, "mb_per_step": 1.0},
    ...         {"variant": "x", "time_to_target_s": None, "mb_per_step": None}]
    >>> print(markdown_table(rows, cols))
    | variant | time to target s | MB/step |
    |---|---|---|
    | ddp | 2.0 | 1.000 |
    | x | not reached | n/a |
    """
    head = "| " + " | ".join(c[0] for c in columns) + " |"
    sep = "|" + "---|" * len(columns)
    body = []
    for r in rows:
        cells = []
        for _, key, spec in columns:
            v = r.get(key)
            spread = r.get(f"{key}_range") if (r.get("repeats") or 1) > 1 else None
            if key == "time_to_target_s" and v is None and "time_to_target_s" in r \
                    and r["variant"] != "none":
                cells.append("not reached")
            elif key == "gap_pct" and v is not None:
                cells.append(format(v, spec) + "%")
            else:
                cells.append(_fmt(v, spec))
            if spread is not None and v is not None and spread[0] != spread[1]:
                lo, hi = (format(x, spec) for x in spread)
                cells[-1] += f" ({lo}–{hi})"
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def write_section(path: str, body: str, title: str = SECTION) -> None:
    """Put ``title`` + ``body`` into markdown file ``path``, replacing only that section.

    Other sections (other ``## `` headings) are kept as they are, in place; a missing file
    is created, a missing section appended.
    """
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    block = f"{title}\n\n{body.strip()}\n"
    pat = re.compile(rf"^{re.escape(title)}\s*$.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(text):
        text = pat.sub(lambda m: block + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def plot(runs_by_panel: dict[str, dict[str, dict]], path: str, title: str = "",
         target: float | None = None, budget_s: float | None = None) -> str | None:
    """Validation loss against wall-clock and against MB sent, one column per panel.

    ``target``: a horizontal line at that loss (the baseline's final one) in every plot;
    ``budget_s``: a vertical line at that training time (the equal-time budget).
    Returns the path written, or ``None`` without matplotlib.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(runs_by_panel)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 8), squeeze=False)
    names = list(dict.fromkeys(k for runs in runs_by_panel.values() for k in runs))
    colors = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(names)}
    for j, (panel, runs) in enumerate(runs_by_panel.items()):
        for name, run in runs.items():
            ev = run["evals"]
            ls = "--" if name.startswith("ddp") or name.startswith("torch") else "-"
            if name == "none":
                ls = ":"
            axes[0][j].plot([e["train_s"] for e in ev], [e["val_loss"] for e in ev], ls,
                            marker=".", label=name, color=colors[name])
            if name != "none":
                axes[1][j].plot([e["bytes"] / 1e6 for e in ev], [e["val_loss"] for e in ev], ls,
                                marker=".", label=name, color=colors[name])
        axes[0][j].set_title(panel, fontsize=9)
        axes[0][j].set(xlabel="training wall-clock (s)", ylabel="validation loss")
        axes[1][j].set(xlabel="MB sent by rank 0", ylabel="validation loss")
        axes[1][j].set_xscale("symlog", linthresh=1.0)
        if budget_s is not None:
            axes[0][j].axvline(budget_s, color="gray", lw=0.8, ls="-.", label="time budget")
        for ax in (axes[0][j], axes[1][j]):
            if target is not None:
                ax.axhline(target, color="gray", lw=0.8, ls=":", label="DDP's final loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    if title:
        import textwrap
        fig.suptitle(textwrap.fill(title, 80 * n), fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
