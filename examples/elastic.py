"""Local SGD that survives a killed rank: torchrun restarts the workers, they resume a round.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 examples/elastic.py [--dir runs/elastic] [--steps 60]

(torch 2.13's torchrun shares one store with the workers across restarts, where
restarted gloo workers can read a peer address the previous attempt left behind; the
variable turns the sharing off.)

Local SGD as in ``local_sgd.py`` (a warm-up with gradient averaging, then exact parameter
averaging every ``--period`` steps), plus a ``RoundCheckpointer`` that saves right after
every round. Kill any worker (``kill -9``): torchrun stops the others and starts new ones
(at most ``--max-restarts`` times); they load the newest round every rank finished saving
and train on. Three things make the resumed run end exactly where an uninterrupted one
does, bit for bit:

* each batch is a function of ``(--seed, rank, step)`` alone, so a step redone after a
  restart sees the data it saw the first time;
* the checkpoint holds everything else a rank's future depends on (model, optimizer
  momentum, the handle's counter and stats);
* the process group's timeout is short (``--timeout``, 30 s), so a rank whose peer died
  fails soon instead of hanging, and torchrun can restart the group.

Everything goes under ``--dir``: ``ckpt/`` (the round checkpoints; torchrun may give a
rank number to another node after a restart, so on several nodes this must be a shared
folder), ``events_rank{r}.jsonl`` (one JSON line per start, resume, saved round and
finish, with a timestamp) and ``final_rank{r}.pt`` (each rank's model and optimizer state
at the end). A run with a ``--dir`` that holds a finished run's checkpoints resumes it.

Fault-injection points for tests, off unless set (each fires once per ``--dir``):
``DDP_AVG_HOOKS_EXAMPLE_PAUSE_AT_STEP=N[:RANK]`` stops RANK (default: the last) before
step N; ``DDP_AVG_HOOKS_EXAMPLE_PAUSE_IN_SAVE=R[:RANK]`` stops it inside its save of round
R, after writing its files and before its completion marker. The rank writes
``{"pid": ..., "steps_done": ...}`` to ``--dir``/``paused-step-N`` (or ``paused-save-R``)
and sleeps, so that a test can kill it right there.
"""
import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.checkpoint import RoundCheckpointer
from _task import make_model, say, shutdown, train_step, validation_loss


def batches_at(seed: int, rank: int, step: int) -> torch.Generator:
    """The generator of ``rank``'s batch at ``step``: the same in every run and attempt."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, rank, step])
                                             .generate_state(1)[0]))


class Events:
    """Appends one JSON line per event to ``events_rank{r}.jsonl``."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path, self.rank = folder / f"events_rank{rank}.jsonl", rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    def __call__(self, event: str, **fields) -> None:
        line = dict(t=time.time(), event=event, rank=self.rank, attempt=self.attempt, **fields)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/elastic")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--period", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="the data order")
    p.add_argument("--timeout", type=float, default=30.0, help="process group timeout, seconds")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, folder = dist.get_rank(), Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    log = Events(folder, rank)
    log("start", pid=os.getpid())

    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=args.period,
                                         warmup_steps=args.warmup, optimizer=opt)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    ckpt = PausingCheckpointer(folder / "ckpt", handle, ddp.module, opt, keep=2)

    restored = ckpt.restore()  # collective: the newest round every rank completed, or None
    log("resume", round=restored, step=handle.step_count)
    if restored is None:
        say(f"attempt {log.attempt}: starting from scratch")
    else:
        say(f"attempt {log.attempt}: resumed from round {restored} at step {handle.step_count}")

    for step in range(handle.step_count, args.steps):
        pause_point("step", step, rank, folder, steps_done=step)
        train_step(ddp, opt, batches_at(args.seed, rank, step))  # handle.step() runs in opt.step()
        if ckpt.maybe_save():
            log("round", round=handle.stats.rounds, step=handle.step_count)

    handle.average()  # every rank ends with the same model
    torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
                "steps": handle.step_count, "rounds": handle.stats.rounds},
               folder / f"final_rank{rank}.pt")
    log("finish", step=handle.step_count, round=handle.stats.rounds)
    say(f"validation loss after {args.steps} steps: {validation_loss(ddp.module):.4f} "
        f"({handle.stats.rounds} rounds)")
    handle.remove()


# --- fault injection for tests (inactive unless the environment asks) -------------------
def pause_point(kind: str, number: int, rank: int, folder: Path, steps_done: int) -> None:
    """Sleep here once if ``DDP_AVG_HOOKS_EXAMPLE_PAUSE_{AT_STEP,IN_SAVE}`` names this point."""
    wanted = os.environ.get({"step": "DDP_AVG_HOOKS_EXAMPLE_PAUSE_AT_STEP",
                             "save": "DDP_AVG_HOOKS_EXAMPLE_PAUSE_IN_SAVE"}[kind])
    if not wanted:
        return
    at, _, who = wanted.partition(":")
    marker = folder / f"paused-{kind}-{at}"
    if int(at) != number or rank != int(who or dist.get_world_size() - 1) or marker.exists():
        return
    marker.with_suffix(".tmp").write_text(json.dumps(dict(pid=os.getpid(), steps_done=steps_done)))
    marker.with_suffix(".tmp").rename(marker)  # the test reads all of it or nothing
    time.sleep(120)  # until killed; the peers fail at their process group timeout otherwise


class PausingCheckpointer(RoundCheckpointer):
    """``RoundCheckpointer`` with the ``in save`` pause point just before its marker."""

    def _mark_completed(self, folder, session):
        pause_point("save", self.handle.stats.rounds, self.rank, self.directory.parent,
                    steps_done=self.handle.step_count)
        super()._mark_completed(folder, session)


if __name__ == "__main__":
    main()
    shutdown()
