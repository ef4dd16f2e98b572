"""The loopback steps studies' command line: every configuration trained over the seeds,
the table of steps to DDP's loss written into its section, and the runs saved (hand-made
validation curves, no training here)."""
from __future__ import annotations

import json
import re

import torch

import bench_period_steps
from harness import steps_study


def _run(*losses, bytes_per_eval=100):
    return {"config": {}, "evals": [{"step": 20 * k, "train_s": k, "bytes": bytes_per_eval * k,
                                     "val_loss": v} for k, v in enumerate(losses, 1)]}


def _isolate(monkeypatch, tmp_path, train_all):
    """Train with ``train_all`` instead, and write into a RESULTS.md and results/ under
    ``tmp_path``; the RESULTS.md, which holds one other section."""
    monkeypatch.setattr(steps_study, "train_all", train_all)
    monkeypatch.setattr(steps_study, "BENCHMARKS", str(tmp_path))
    (tmp_path / "results").mkdir()
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Another section\n\nkept\n")
    return results


def test_a_study_trains_every_configuration_and_writes_its_section(monkeypatch, tmp_path):
    trained = {}

    def train_all(configs, seeds, runs_dir, *, steps, budget, timeout_s):
        trained.update(configs=configs, seeds=seeds, steps=steps, budget=budget)
        # DDP reaches 2.0 at step 200; every other configuration at step 200 on seed 0,
        # and on seed 1 halfway between its validations at 200 (2.1) and 220 (1.9)
        curves = {0: (2.2, 2.0, 1.9), 1: (2.2, 2.1, 1.9)}
        return {s: {n: (_run(*[3.0] * 9, 2.0) if n == "ddp"
                        else _run(*[3.0] * 9, *curves[s][1:], bytes_per_eval=10))
                    for n in configs} for s in seeds}

    results = _isolate(monkeypatch, tmp_path, train_all)
    assert bench_period_steps.main(["--seeds", "0,1", "--results-md", str(results)]) == 0

    assert trained["seeds"] == [0, 1] and trained["steps"] == 300
    assert all(flags[:4] == ["--lr", "0.001", "--lr-warmup", "20"]
               for flags in trained["configs"].values())
    assert trained["configs"]["int4_overlap, period 2 to step 100, then 8"][4:] == [
        "--hook", "int4_overlap", "--period", "2", "--period-after", "100:8"]
    text = results.read_text()
    assert "## Another section\n\nkept" in text
    section = text[text.index("## Fewer steps to the target: where the period costs steps"):]
    # seed 0: at or below 2.0 first at step 200 -> 1.000; seed 1: 200 + 20 * 0.1 / 0.2 = 210
    assert "| `allreduce, period 1` | 1.000 | 1.050 | 1.025 | 1.0 |" in section
    assert "`ddp`" not in section
    saved = json.loads((tmp_path / "results" / "period_steps.json").read_text())
    assert saved["command"] == "python benchmarks/bench_period_steps.py --seeds 0,1 " \
                               f"--results-md {results}"
    assert set(saved["runs"]) == {"0", "1"} and len(saved["runs"]["0"]) == len(trained["configs"])


def test_the_compression_study_writes_the_loss_at_equal_steps_against_its_reference(
        monkeypatch, tmp_path):
    import bench_compression_steps
    from harness import train

    trained = {}

    def train_all(configs, seeds, runs_dir, *, steps, budget, timeout_s):
        trained.update(configs)
        # every run validates at 20, ..., 200; the loss at 200: 2.0 for the reference,
        # 2.01 for int4 (+0.50%), 2.1 for everything else (+5.00%)
        losses = {"torch_localsgd": 2.0, "int4": 2.01}
        return {s: {n: _run(*[3.0] * 9, losses.get(n, 2.1),
                            bytes_per_eval=8 if n == "torch_localsgd" else 1)
                    for n in configs} for s in seeds}

    results = _isolate(monkeypatch, tmp_path, train_all)
    assert bench_compression_steps.main(["--seeds", "0,1", "--results-md", str(results)]) == 0

    text = results.read_text()
    section = text[text.index("## Compressed rounds at equal steps: against "
                              "PeriodicModelAverager"):]
    assert "| `torch_localsgd` | 2.000 | 2.000 | +0.00% | +0.00% | 1.000 |" in section
    assert "| `int4` | 2.010 (+0.50%) | 2.010 (+0.50%) | +0.50% | +0.50% | 0.125 |" in section
    # each configuration's flags as train.py reads them: a study's lr comes first, so
    # DiLoCo's own inner lr and period must win
    parsed = {n: train.parse_args(flags) for n, flags in trained.items()}
    assert parsed["torch_localsgd"].hook == "torch_localsgd" and parsed["int4"].period == 8
    assert (parsed["diloco_int4"].lr, parsed["diloco_int4"].period) == (3e-4, 32)
    assert parsed["int4_streaming"].lr == 1e-3


def test_the_validation_study_validates_every_configuration_on_eight_times_the_batches():
    import bench_validation_steps
    from harness import train

    parsed = {n: train.parse_args(["--lr", "0.001", *flags])
              for n, flags in bench_validation_steps.CONFIGS.items()}
    assert set(parsed) == {"ddp", "allreduce", "int4"}
    default = train.parse_args([]).eval_batches
    assert all(a.eval_batches == 8 * default for a in parsed.values())
    assert (parsed["allreduce"].hook, parsed["allreduce"].period) == ("allreduce", 8)


def test_the_fragment_study_runs_each_overlapped_hook_in_both_layouts():
    import bench_fragment_steps
    from harness import train, variants

    parsed = {n: train.parse_args(["--lr", "0.001", *flags])
              for n, flags in bench_fragment_steps.CONFIGS.items()}
    layouts = {}
    for name, args in parsed.items():
        if name == "ddp":
            continue
        assert (args.period, args.fragments) == (8, 4)
        options = train._stream_options(variants.VARIANTS[args.hook], args)
        assert options["fragments"] == 4
        layouts.setdefault(options["fragment_layout"], []).append(args.hook)
    assert sorted(layouts["contiguous"]) == ["int4_streaming"] * 2 + ["int8_streaming"]
    assert sorted(layouts["interleaved"]) == ["int4_streaming_interleaved"] * 2 + [
        "int8_streaming_interleaved"]


def test_the_seed_study_trains_forty_seeds_and_counts_those_within_the_target(
        monkeypatch, tmp_path):
    import bench_seed_steps
    from harness import train

    trained = {}

    def train_all(configs, seeds, runs_dir, *, steps, budget, timeout_s):
        trained.update(configs=configs, seeds=seeds)
        # on the first data order DDP reaches 2.0 at step 200; exact averaging at 220 on
        # every seed; the overlapped configuration at 200 on even seeds and halfway between
        # 220 (2.1) and 240 (1.9) on odd ones: 230 steps, 1.15x. On the other order DDP
        # goes from 3.0 at 180 to 1.9 at 200 (the first order's 2.0 at 180 + 20 / 1.1 steps:
        # 0.991x) and every method reaches 1.9 at 240 (1.2x; against the first order's
        # 2.0 it would be 1.1x)
        def curve(name, s):
            if name == "ddp":
                return _run(*[3.0] * 9, 2.0)
            if name == "ddp_other_data_order":
                return _run(*[3.0] * 9, 1.9)
            if name.endswith("_other_data_order"):
                return _run(*[3.0] * 9, 2.2, 2.0, 1.9)
            if name == "allreduce" or s % 2:
                return _run(*[3.0] * 9, 2.2, 2.1 if s % 2 and name != "allreduce" else 2.0,
                            1.9)
            return _run(*[3.0] * 9, 2.0, 1.9)
        return {s: {n: curve(n, s) for n in configs} for s in seeds}

    results = _isolate(monkeypatch, tmp_path, train_all)
    assert bench_seed_steps.main(["--results-md", str(results)]) == 0

    assert trained["seeds"] == list(range(40))
    parsed = {n: train.parse_args(flags) for n, flags in trained["configs"].items()}
    ours = "int4_streaming_interleaved_next_step"
    assert parsed["allreduce"].period == parsed[ours].period == 8
    assert parsed[ours].hook == ours
    for name in ("ddp", "allreduce", ours):
        other = parsed[f"{name}_other_data_order"]
        assert (other.hook, other.period, other.data_seed_offset) == \
            (parsed[name].hook, parsed[name].period, 100)
        assert parsed[name].data_seed_offset == 0
    section = results.read_text()
    section = section[section.index("## Steps to the target over many seeds"):]
    assert "| mean | median | within 1.10x | bytes x |" in section
    assert "| `ddp_other_data_order` | " + " | ".join(["0.991"] * 40) + \
        " | 0.991 | 0.991 | 40 of 40 |" in section
    assert "| `allreduce` | " + " | ".join(["1.100"] * 40) + " | 1.100 | 1.100 | 40 of 40 |" \
        in section
    assert f"| `{ours}` | " + " | ".join(
        ["1.000", "1.150"] * 20) + " | 1.075 | 1.075 | 20 of 40 |" in section
    # against DDP on the same (other) order, not the first
    assert f"| `{ours}_other_data_order` | " + " | ".join(["1.200"] * 40) + \
        " | 1.200 | 1.200 | 0 of 40 |" in section
    # pooled: 80 samples a method; each interval holds its statistic, within the sample
    pooled = {m.group(1): [float(x) for x in m.groups()[1:7]] + [m.group(8)]
              for m in re.finditer(r"\| (.+), both data orders \| 80 \| ([\d.]+) \(([\d.]+)-"
                                   r"([\d.]+)\) \| ([\d.]+) \(([\d.]+)-([\d.]+)\) \| "
                                   r"(\d+ of 80) \|", section)}
    assert pooled["`allreduce`"][0] == 1.15 and pooled["`allreduce`"][3] == 1.15
    assert pooled[f"`{ours}`"][0] == 1.137 and pooled[f"`{ours}`"][3] == 1.175
    assert (pooled["`allreduce`"][6], pooled[f"`{ours}`"][6]) == ("40 of 80", "20 of 80")
    for mean, low, high, median, m_low, m_high, _ in pooled.values():
        assert 1.0 <= low <= mean <= high <= 1.2 and 1.0 <= m_low <= median <= m_high <= 1.2


def test_the_budget_study_reads_each_later_budget_from_the_same_runs(monkeypatch, tmp_path):
    import bench_budget_steps
    from harness import train

    trained = {}

    def train_all(configs, seeds, runs_dir, *, steps, budget, timeout_s):
        trained.update(configs=configs, seeds=seeds, steps=steps, budget=budget)
        # validations every 20 steps to step 1000. DDP: 2.0 at 200, 1.5 at 400, 1.0 at 800.
        # exact averaging: each of DDP's losses 20 steps later (1.1x at 200, 1.05x at 400,
        # 1.025x at 800); ours: 2.0 at 230 (halfway between 220 and 240), 1.5 at 400 (at 360
        # on odd seeds: 0.9x), 1.0 never
        def curve(name, s):
            at = {"ddp": {200: 2.0, 400: 1.5, 800: 1.0},
                  "allreduce": {220: 2.0, 420: 1.5, 820: 1.0},
                  bench_budget_steps.OURS: {220: 2.1, 240: 1.9, 400 - 40 * (s % 2): 1.5}}[name]
            losses, last = [], 3.0
            for step in range(20, 1001, 20):
                last = at.get(step, last)
                losses.append(last)
            return _run(*losses)
        return {s: {n: curve(n, s) for n in configs} for s in seeds}

    results = _isolate(monkeypatch, tmp_path, train_all)
    assert bench_budget_steps.main(["--results-md", str(results)]) == 0

    assert trained["seeds"] == list(range(8)) and trained["steps"] == 1000
    parsed = {n: train.parse_args(flags) for n, flags in trained["configs"].items()}
    assert set(parsed) == {"ddp", "allreduce", bench_budget_steps.OURS}
    assert parsed["allreduce"].period == parsed[bench_budget_steps.OURS].period == 8
    section = results.read_text()
    section = section[section.index("## Steps to the target after longer training"):]
    ours = bench_budget_steps.OURS
    tables = section.split("Steps to DDP's loss at ")
    assert [t[:3] for t in tables[1:]] == ["200", "400", "800"]
    assert "| `allreduce` | " + " | ".join(["1.100"] * 8) + " | 1.100 | 1.100 | 8 of 8 |" \
        in tables[1]
    assert f"| `{ours}` | " + " | ".join(["1.150"] * 8) + " | 1.150 | 1.150 | 0 of 8 |" \
        in tables[1]
    assert "| `allreduce` | " + " | ".join(["1.050"] * 8) + " | 1.050 | 1.050 | 8 of 8 |" \
        in tables[2]
    assert f"| `{ours}` | " + " | ".join(["1.000", "0.900"] * 4) + \
        " | 0.950 | 0.950 | 8 of 8 |" in tables[2]
    assert "| `allreduce` | " + " | ".join(["1.025"] * 8) in tables[3]
    assert f"| `{ours}` | " + " | ".join(["not reached"] * 8) + " | - | - | 0 of 8 |" \
        in tables[3]


def test_another_data_order_changes_the_batches_and_not_the_model():
    from harness import train

    def first_batch(*flags):
        args = train.parse_args(["--preset", "bench", *flags])
        return torch.randint(1000, (4,), generator=train.batch_generator(args, rank=1))

    same = first_batch("--seed", "3")
    assert torch.equal(first_batch("--seed", "3", "--data-seed-offset", "0"), same)
    assert not torch.equal(first_batch("--seed", "3", "--data-seed-offset", "100"), same)
    # seed 3's batches with offset 4 are seed 7's
    assert torch.equal(first_batch("--seed", "3", "--data-seed-offset", "4"),
                       first_batch("--seed", "7"))


def test_reuse_reads_only_runs_made_by_the_same_arguments(monkeypatch, tmp_path):
    from harness import launch, train

    trained = []
    monkeypatch.setattr(launch, "run_training",
                        lambda args, out, timeout_s: trained.append(out) or _run(2.0))
    flags = {"a": ["--hook", "allreduce", "--period", "8"], "b": ["--hook", "ddp"]}
    common = ["--preset", "bench", "--steps", "300", "--eval-every", "20", "--seed", "0",
              "--progress", "off"]
    for name, lr in (("a", "0.001"), ("b", "0.002")):  # b's run had another --lr
        made = vars(train.parse_args([*common, *flags[name], "--lr", lr]))
        (tmp_path / "seed0" / name).mkdir(parents=True)
        (tmp_path / "seed0" / name / "metrics.json").write_text(
            json.dumps({**_run(1.5), "config": {**made, "out": "elsewhere", "n_params": 7}}))
    configs = {n: [*f, "--lr", "0.001"] for n, f in flags.items()}

    reused = []
    runs = steps_study.train_all(configs, [0], str(tmp_path), steps=300, budget=20,
                                 timeout_s=1, reused=reused)
    assert reused == ["0/a"] and trained == [str(tmp_path / "seed0" / "b")]
    assert runs[0]["a"]["evals"][0]["val_loss"] == 1.5  # read, not trained
    trained.clear()
    steps_study.train_all(configs, [0], str(tmp_path), steps=300, budget=20, timeout_s=1)
    assert len(trained) == 2  # without reuse every run trains


def test_the_bootstrap_interval_is_the_resampled_statistics_quantiles():
    import statistics

    # the mean of 2 draws from [0, 10] is 0, 5 or 10 with probabilities 1/4, 1/2, 1/4:
    # its 30% and 70% quantiles are 5, its 5% and 95% quantiles 0 and 10
    assert steps_study.bootstrap_interval([0.0, 10.0], statistics.mean, level=0.4) == (5, 5)
    assert steps_study.bootstrap_interval([0.0, 10.0], statistics.mean, level=0.9) == (0, 10)
    sample = [1.0, 1.3, 0.9, 1.2, 1.1]
    assert steps_study.bootstrap_interval(sample, statistics.median) == \
        steps_study.bootstrap_interval(sample, statistics.median)  # seeded
