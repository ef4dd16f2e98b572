"""Run under torchrun (2 ranks) by test_integrations.py: the Accelerate example, then
parity with ``accelerate.local_sgd.LocalSGD``, a second ``with`` block, uneven inputs
under ``Join``, ``enabled=False``.

Rank 0 prints one ``check <name>: ...`` line per check; any failed check raises.
"""
import os
import sys

import accelerate.local_sgd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from torch.distributed.algorithms.join import Join

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
from _helpers import exit_cleanly, report  # noqa: E402
import accelerate_local_sgd as ex  # noqa: E402

from ddp_avg_hooks.integrations.accelerate import LocalSGD  # noqa: E402

K, STEPS = 4, 22


def train(accelerator, make_local_sgd, steps=STEPS, shared=0, flags=None):
    """``steps`` SGD steps; the first ``shared`` batches are the same on every rank.
    ``flags``: a list that gets DDP's ``require_backward_grad_sync`` after each step and,
    last, after the ``with`` block."""
    model = ex.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    g_shared = torch.Generator().manual_seed(0)
    g_rank = torch.Generator().manual_seed(100 + dist.get_rank())
    with make_local_sgd(model) as local_sgd:
        for step in range(steps):
            x = torch.randn(16, 16, generator=g_shared if step < shared else g_rank)
            loss = F.mse_loss(model(x), torch.sin(x[:, :4]).sum(1, keepdim=True))
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            local_sgd.step()
            if flags is not None:
                flags.append(model.require_backward_grad_sync)
    if flags is not None:
        flags.append(model.require_backward_grad_sync)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(), model




def main():
    ex.main()
    accelerator = Accelerator(cpu=True)
    # accelerate's LocalSGD: no_sync throughout, averages after steps K, 2K, ... and on exit.
    # Ours with warmup_steps=K-1 rounds after the same steps; its warm-up averages gradients,
    # which changes nothing while both ranks see the same batches (the first K-1).
    theirs, _ = train(accelerator, lambda m: accelerate.local_sgd.LocalSGD(accelerator, m, K),
                      shared=K - 1)
    flags = []
    ours, model = train(accelerator, lambda m: LocalSGD(accelerator, m, K, warmup_steps=K - 1),
                        shared=K - 1, flags=flags)
    report("parity_accelerate_local_sgd", torch.equal(theirs, ours),
           f"max |diff| {(theirs - ours).abs().max().item():.1e}")
    report("replicas_agree_on_exit", ex.spread(model) == 0.0, "")
    # DDP's reducer runs through the warm-up, is off from the first local backward on, and
    # runs again after the block
    report("reducer_off_after_warmup",
           flags == [True] * (K - 1) + [False] * (STEPS - K + 1) + [True],
           f"require_backward_grad_sync after each step, then after the block: {flags}")

    # the same model in two blocks: the comm hook DDP takes once serves both
    model = accelerator.prepare(ex.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for block in range(2):
        with LocalSGD(accelerator, model, 3) as local_sgd:
            for _ in range(5):
                x = torch.randn(8, 16) * (1 + dist.get_rank())
                accelerator.backward(model(x).pow(2).mean())
                opt.step(); opt.zero_grad(); local_sgd.step()
            rounds = local_sgd.handle.stats.rounds
        report(f"block_{block}_rounds_and_agree", rounds == 2 and ex.spread(model) == 0.0,
               f"rounds {rounds}")

    # uneven inputs: torch's Join of the prepared model and the handle (Accelerate's
    # join_uneven_inputs does nothing on CPU processes)
    model = accelerator.prepare(ex.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with LocalSGD(accelerator, model, 3) as local_sgd:
        with Join([model, local_sgd.handle]):
            for _ in range(7 + 3 * dist.get_rank()):  # rank 1 has 3 batches more
                x = torch.randn(8, 16) * (1 + dist.get_rank())
                accelerator.backward(model(x).pow(2).mean())
                opt.step(); opt.zero_grad(); local_sgd.step()
        steps, rounds = local_sgd.handle.step_count, local_sgd.handle.stats.rounds
    report("uneven_inputs_join", steps == 10 and rounds == 4 and ex.spread(model) == 0.0,
           f"steps {steps}, rounds {rounds}")

    off = LocalSGD(accelerator, model, 3, enabled=False)
    with off:
        off.step()
    report("disabled_is_noop", off.handle is None and off.num_steps == 1, "")


if __name__ == "__main__":
    main()
    exit_cleanly()
