"""Hierarchical averaging on 4 gloo ranks as 2 nodes of 2, against a single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import flat, make_model as _make_model, train_step

LR = 0.05
STEPS = 8
INTRA_PERIOD, GLOBAL_PERIOD = 2, 3  # node rounds after steps 0, 2, 4, 6; global after 0, 3, 6


DIMS = (6, 8, 3)


def make_model() -> torch.nn.Module:
    return _make_model(dims=DIMS)


def local_step(model, opt, rank, step):
    train_step(model, opt, rank, step, n=5, dims=DIMS)


def _train(rank, groups, intra_hook, intra_state, global_hook, global_state):
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    # registration order = step order: the node round runs first at a shared step
    intra = dah.register_averaging_hook(ddp, intra_hook, intra_state, period=INTRA_PERIOD,
                                        optimizer=opt)
    inter = dah.register_averaging_hook(ddp, global_hook, global_state, period=GLOBAL_PERIOD,
                                        optimizer=opt)
    ddp.register_comm_hook(inter, dah.grad_hooks.local_sgd_grad_hook)
    snapshots = []
    for step in range(STEPS):
        local_step(ddp, opt, rank, step)
        snapshots.append(flat(ddp.module))
    return {"params": torch.stack(snapshots), "intra": (intra.stats.rounds, intra.stats.bytes_sent),
            "global": (inter.stats.rounds, inter.stats.bytes_sent)}


def _rank_hierarchy(rank, world_size):
    groups = dah.hierarchy.node_groups(ranks_per_node=2)
    out = {
        "layout": (groups.nodes, groups.node, groups.local_rank,
                   dist.get_process_group_ranks(groups.intra),
                   dist.get_process_group_ranks(groups.cross),
                   (dist.get_process_group_ranks(groups.leaders)
                    if groups.local_rank == 0 else None)),
        "exact": _train(rank, groups, dah.hooks.allreduce_hook, groups.intra,
                        dah.hooks.allreduce_hook, None),
        # the recipe: exact in the node, PowerSGD across all ranks
        "powersgd": _train(rank, groups, dah.hooks.allreduce_hook, groups.intra,
                           dah.hooks.powersgd_hook, dah.hooks.PowerSGDState()),
    }
    # a compressed node hook on the node group, the exact global one
    out["fp16"] = _train(rank, groups, dah.hooks.fp16_compress_hook,
                         dah.hooks.HalfDeltaState(groups.intra), dah.hooks.allreduce_hook, None)
    # the cross groups: ranks with the same local rank agree after a round on them
    model = make_model()
    ddp = DDP(model)  # broadcasts rank 0's parameters: set them after
    with torch.no_grad():
        model[0].weight.fill_(rank)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, groups.cross)
    handle.step()
    out["cross"] = model[0].weight[0, 0].item()
    return out


def _reference():
    """Four replicas in one process: node means (pairs) then the global mean, by schedule."""
    models = [make_model() for _ in range(4)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    snapshots = []

    def set_mean(ranks):
        mean = torch.stack([flat(models[r]) for r in ranks]).mean(0)
        for r in ranks:
            torch.nn.utils.vector_to_parameters(mean.clone(), models[r].parameters())

    for step in range(STEPS):
        for rank in range(4):
            local_step(models[rank], opts[rank], rank, step)
        if step % INTRA_PERIOD == 0:
            set_mean([0, 1])
            set_mean([2, 3])
        if step % GLOBAL_PERIOD == 0:
            set_mean([0, 1, 2, 3])
        snapshots.append(torch.stack([flat(m) for m in models]))
    return torch.stack(snapshots, dim=1)  # [rank, step, numel]


def test_two_nodes_of_two_agree_in_the_node_then_globally_and_match_the_reference():
    ranks = run_ranks(_rank_hierarchy, world_size=4)
    assert [r["layout"] for r in ranks] == [
        (2, 0, 0, [0, 1], [0, 2], [0, 2]),
        (2, 0, 1, [0, 1], [1, 3], None),
        (2, 1, 0, [2, 3], [0, 2], [0, 2]),
        (2, 1, 1, [2, 3], [1, 3], None),
    ]
    assert [r["cross"] for r in ranks] == [1.0, 2.0, 1.0, 2.0]  # means of ranks (0, 2) and (1, 3)

    ref = _reference()
    numel = ref.shape[-1]
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["exact"]["params"], ref[rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["fp16"]["params"], ref[rank], rtol=0, atol=2e-3)
        for case in ("exact", "powersgd", "fp16"):
            # each handle counts its own traffic: node rounds and global rounds apart
            assert r[case]["intra"][0] == 4 and r[case]["global"][0] == 3
        assert r["exact"]["intra"][1] == r["powersgd"]["intra"][1] == 4 * numel * 4
        assert r["exact"]["global"][1] == 3 * numel * 4
        assert r["fp16"]["intra"][1] == 4 * numel * 2
        assert 0 < r["powersgd"]["global"][1] < r["exact"]["global"][1]

    for case in ("exact", "powersgd", "fp16"):
        p = [r[case]["params"] for r in ranks]
        for step in range(STEPS):
            same = lambda a, b: torch.equal(p[a][step], p[b][step])  # noqa: E731
            if step % GLOBAL_PERIOD == 0:
                assert all(same(0, b) for b in (1, 2, 3)), (case, step)
            elif step % INTRA_PERIOD == 0:
                assert same(0, 1) and same(2, 3) and not same(0, 2), (case, step)
            else:
                assert not same(0, 1) and not same(2, 3), (case, step)
