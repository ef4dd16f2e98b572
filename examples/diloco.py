"""DiLoCo on DDP: the replicas' averaged change is a gradient for an outer optimizer.

    torchrun --nproc-per-node 2 examples/diloco.py [--steps 65] [--period 16] [--inner fp16]

Each rank trains alone with AdamW for ``--period`` steps. At a round,
``hooks.outer_optimizer`` averages the change since the last round with the inner hook
(``fp16_compress_hook``: sent as float16; ``--inner exact``: ``allreduce_hook``) and hands
it to an outer Nesterov SGD (DiLoCo's lr 0.7, momentum 0.9), which takes the same step on
every rank. That outer step is up to 0.7 / (1 - 0.9) = 7x a round's averaged change, so the
inner learning rate is several times smaller than plain training's: AdamW at 3e-3 learns
this task on one process; here the inner AdamW runs at 3e-4. Rounds run at steps 1,
1 + period, 1 + 2 * period, ... (PyTorch's ``PeriodicModelAverager`` schedule).
"""
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _task import (check_agreement, ddp_bytes, make_model, rank_batches, replica_spread, say,
                   shutdown, train_step, validation_loss)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=65)
    p.add_argument("--period", type=int, default=16)
    p.add_argument("--inner", choices=("fp16", "exact"), default="fp16")
    p.add_argument("--lr", type=float, default=3e-4, help="the inner AdamW learning rate")
    args = p.parse_args()

    dist.init_process_group("gloo")
    ddp = DDP(make_model())
    inner_opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    if args.inner == "fp16":  # the compressed hook keeps its error feedback in HalfDeltaState
        hook = dah.hooks.outer_optimizer(dah.hooks.fp16_compress_hook)
        state = dah.hooks.OuterOptimizerState(dah.hooks.HalfDeltaState())
    else:
        hook = dah.hooks.outer_optimizer(dah.hooks.allreduce_hook)
        state = dah.hooks.OuterOptimizerState(None)
    # OuterOptimizerState(inner_state) alone is DiLoCo's SGD(lr=0.7, momentum=0.9, nesterov=True);
    # e.g. OuterOptimizerState(inner_state, lr=0.5) or (inner_state, torch.optim.Adam, lr=1e-2)
    handle = dah.register_averaging_hook(ddp, hook, state, period=args.period, optimizer=inner_opt)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)  # no gradient all-reduce

    gen = rank_batches()
    say(f"validation loss before training: {validation_loss(ddp.module):.4f}")
    worst = 0.0
    for step in range(1, args.steps + 1):
        rounds = handle.stats.rounds
        train_step(ddp, inner_opt, gen)  # and, every `period` steps, a round with its outer step
        if handle.stats.rounds > rounds:
            spread = replica_spread(ddp.module)
            worst = max(worst, spread)
            val = validation_loss(ddp.module)
            say(f"step {step:3d}  round {handle.stats.rounds}  validation loss {val:.4f}  "
                f"replicas differ by {spread:.1e}")

    # No handle.average() here: for DiLoCo it would be one more outer step, momentum included.
    # The run ends on a scheduled round instead (--steps 65 = 4 periods of 16, plus 1).
    say(f"validation loss after {args.steps} steps: {validation_loss(ddp.module):.4f}")
    sent, ddp_sent = handle.stats.bytes_sent, ddp_bytes(ddp, args.steps)
    say(f"sent {sent / 1e3:.1f} kB in {handle.stats.rounds} rounds ({args.inner}); DDP would send "
        f"{ddp_sent / 1e3:.1f} kB ({ddp_sent / sent:.0f}x more)")
    check_agreement(worst)
    handle.remove()


if __name__ == "__main__":
    main()
    shutdown()
