"""The variant records (``harness/variants.py``) against ``train.py``'s description of them."""
from __future__ import annotations

import re

from harness import train, variants


def test_train_docstring_lists_exactly_the_recorded_variants():
    doc = train.__doc__
    section = doc[doc.index("``--hook`` picks"):doc.index("Rank 0 writes")]
    listed = {w for w in re.findall(r"``([a-z0-9_]+)``", section) if not w.startswith("_")}
    named = listed & set(variants.VARIANTS)
    hook_names = {"allreduce_hook", "fp16_compress_hook", "int2_compress_hook",
                  "int4_compress_hook", "fully_shard"}
    assert named == set(variants.VARIANTS), set(variants.VARIANTS) - named
    assert listed - named <= hook_names, listed - named  # no name that is not a record


def test_records_are_consistent():
    for name, spec in variants.VARIANTS.items():
        assert spec.name == name
        assert (spec.weighting is not None) == (spec.family == variants.TIMED), name
        assert bool(spec.needs) == (spec.family == variants.PEER) == (spec.library is not None)
        if spec.inner_hook is not None:  # DiLoCo's rounds block
            assert spec.hook == "outer_optimizer" and spec.state == "outer" and not spec.overlap


def test_summary_without_local_steps_and_with_the_loops_own_keys(monkeypatch):
    from harness import records

    def all_gather(out, mine):  # one rank
        out[0].copy_(mine)
    monkeypatch.setattr(records.dist, "all_gather", all_gather)

    class Meter:
        def uninstall(self):
            pass

    class Slow:
        sleep_s = 0.0

        def describe(self):
            return None

    steps = [dict(step=i, loss=1.0, step_s=0.5, bytes=8, comm_s=0.25, averaged=True)
             for i in range(2)]
    s = records.summarize(steps, [dict(val_loss=2.0)], rank=0, world=1, meter=Meter(),
                          slow=Slow(), handles=(None,), train_s=1.0, total_bytes=16,
                          val_wait_s=0.0, wire=(None, None), stopped_by="rounds", eval_s=0.1,
                          rounds_budget=3)
    assert s["median_local_step_s"] is None and s["handle_stats"] is None
    assert s["bytes_per_step"] == 8 and s["comm_share"] == 0.5 and s["per_rank_steps"] == [2]
    assert list(s)[-2:] == ["eval_s", "rounds_budget"]
