"""The checks' cost benchmark: its section holds one row per check, each beside what it
guards (a short run on 2 gloo ranks; the figures are not judged)."""
from __future__ import annotations

import re

import bench_check_cost


def test_every_check_is_timed_beside_what_it_guards(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Another section\n\nkept\n")
    assert bench_check_cost.main(["--reps", "2", "--results-md", str(results)]) == 0
    text = results.read_text()
    assert "## Another section\n\nkept" in text
    section = text[text.index(bench_check_cost.SECTION):]
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| (.+?) \| ([\d.]+) \| ([\d.]+)% \|$", section, re.M)
    assert [r[2] for r in rows] == ["a warm-up step", "a round with both moments",
                                    "a round with both moments"]
    for _, check_ms, _, guarded_ms, share in rows:
        assert float(guarded_ms) > 0
        assert abs(float(share) - 100 * float(check_ms) / float(guarded_ms)) < 0.01 + \
            1e-3 * float(share)  # the share is the check over what it guards
