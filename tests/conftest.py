import os

import pytest
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The framework check scripts and the torchft worker run as programs (under torchrun, by
# test_integrations.py and test_torchft.py). They hold no doctests; importing them for
# --doctest-modules would import Transformers, Lightning and Accelerate in every pytest
# process (~12 s of CPU each at collection). One that gains a doctest is collected again.
_SCRIPTS = ("_hf_checks.py", "_lightning_checks.py", "_accelerate_checks.py", "_torchft_worker.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _has_doctest(name: str) -> bool:
    try:
        with open(os.path.join(_HERE, name)) as f:
            return ">>>" in f.read()
    except OSError:
        return False


collect_ignore = [name for name in _SCRIPTS if not _has_doctest(name)]


@pytest.fixture
def world1():
    """A one-rank gloo world in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# --- pytest -n N: the longest tests first ----------------------------------------------
# The suite's wall time under `make test` (2 workers, 2 cores) is set by its multi-process
# tests: torchrun jobs, example scripts and spawned ranks, 3-50 s each. xdist's default
# `load` schedule hands out tests in collection order in large chunks, so most of the
# longest (benchmarks/tests, collected last) come at the end, where one worker can be left
# holding several while the other has nothing to do. This schedule hands out one test at
# a time (a module whose tests share a module-scoped fixture as one unit, so the fixture
# still runs once), the longest first by the rough costs below, then every other test in
# collection order. It only changes which worker runs a test when: every test still runs.
# A missing or stale entry only costs some balance. Costs: seconds per test (each
# parametrization) as measured under `make test` on 2 cores.
_COST_S = {
    "tests/test_elastic.py": 100,  # the module: an uninterrupted run plus two with kills
    "tests/test_reliability.py::test_ten_thousand_steps_do_not_grow_resident_memory": 45,
    "tests/test_user_examples.py::test_example_trains_and_replicas_agree": 25,
    "tests/test_integrations.py::test_lightning": 31,
    "tests/test_integrations.py::test_hf_trainer": 23,
    "tests/test_integrations.py::test_accelerate": 18,
    "benchmarks/tests/test_examples.py::test_hierarchical_counts_node_and_global_rounds_separately": 26,
    "benchmarks/tests/test_examples.py::test_ddp_trains_and_counts_gradient_bytes": 25,
    "benchmarks/tests/test_examples.py::test_diloco_variants_train_and_send_their_inner_hooks_bytes": 23,
    "benchmarks/tests/test_examples.py::test_time_budget_and_timed_validation": 22,
    "benchmarks/tests/test_examples.py::test_local_sgd_trains_and_bytes_agree_with_handle_stats": 20,
    "benchmarks/tests/test_peers.py::test_torchft_streaming_diloco_syncs_one_fragment_at_a_time": 28,
    "benchmarks/tests/test_peers.py::test_our_streaming_diloco_takes_fragments_in_turns": 25,
    "benchmarks/tests/test_peers.py::test_torchft_diloco_syncs_every_period_through_its_manager": 24,
    "benchmarks/tests/test_peers.py::test_accelerate_localsgd_averages_every_period": 21,
    "benchmarks/tests/test_uneven.py": 19,  # the module (a module-scoped fixture)
    "tests/test_readme.py::test_readme_training_example_runs_under_torchrun": 20,
    "tests/test_memory.py::test_memory_does_not_grow_over_many_rounds": 16,
    "tests/test_torchft.py": 14,
    "tests/test_ext.py::test_cuda_kernels_compile_alone": 9,
    "tests/test_quantized_hooks.py": 20,  # the module (two module-scoped fixtures)
    "tests/test_checkpoint.py::test_stop_and_resume_is_bit_identical": 7,
    "tests/test_checkpoint.py::test_a_round_one_rank_did_not_finish_saving_is_not_used": 5,
    "tests/test_checkpoint.py::test_overlapped_rounds_keep_a_model_per_rank": 5,
    "tests/test_compress_hooks.py::test_error_feedback_bounds_long_run_drift": 8,
    "tests/test_reliability.py::test_a_dead_or_silent_peer_gives_an_error_within_the_timeout": 5,
    "tests/test_every_seconds.py::test_fast_rank_takes_more_steps_and_rounds_match": 4,
    "tests/test_optim.py": 3,
    "tests/test_offload.py": 3,
    "tests/test_zero_copy.py": 3,
    "tests/test_registry_dist.py": 3,
    "tests/test_policies.py": 2,
    "tests/test_powersgd.py": 2,
    "tests/test_reliability.py": 2,
    "tests/test_every_seconds.py": 2,
    "tests/test_fragments.py": 2,
    "tests/test_compile.py": 1,
    "tests/test_integrations.py": 3,
    "tests/test_hierarchy.py": 2,
    "tests/test_outer.py": 1,
    "tests/test_overlap.py": 1,
    "ddp_avg_hooks/checkpoint.py": 6,
}
# modules with a module-scoped fixture: scheduled as one unit
_ONE_UNIT = ("tests/test_elastic.py", "tests/test_quantized_hooks.py",
             "benchmarks/tests/test_uneven.py", "benchmarks/tests/test_bench_targets.py")


def _cost(nodeid: str) -> float:
    """The cost of the most specific entry of _COST_S that nodeid falls under."""
    key = nodeid.split("@", 1)[0].split("[", 1)[0]
    while key:
        if key in _COST_S:
            return _COST_S[key]
        key = key.rpartition("::")[0]
    return 0.0


def _unit_cost(scope: str, nodeids) -> float:
    if scope in _ONE_UNIT:  # the module's entry is its total
        return _COST_S.get(scope) or sum(_cost(n) for n in nodeids)
    return _cost(scope)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":  # an explicit --dist gets what it asked for
        return None
    from xdist.scheduler import LoadScopeScheduling

    if not all(hasattr(LoadScopeScheduling, a) for a in ("_split_scope", "_assign_work_unit")):
        return None  # an xdist whose scope scheduler works otherwise: its default schedule

    class LongestFirst(LoadScopeScheduling):
        _ordered = False  # sorted() is stable: ties keep collection order

        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if module in _ONE_UNIT else nodeid

        def _assign_work_unit(self, node):
            if not self._ordered:  # the first call: the queue holds every unit
                self._ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: -_unit_cost(*unit))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
