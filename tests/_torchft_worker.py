"""One torchft replica group (one process) for test_torchft.py.

Trains a small model under a ``torchft.Manager`` and averages it with this library's
hooks across the replica groups the lighthouse puts in each quorum. After every step it
appends a JSON record to ``<dir>/<tag>.jsonl``: the step, whether a round ran and was
committed, the quorum's participant count, and the flat parameters before and after the
round. The test steers it with files in ``<dir>``: ``--wait-to-begin`` waits for
``<tag>.begin`` before making the Manager; ``<tag>.ready`` (written once the Manager
exists) waits for ``start``; ``--hold-at S`` writes ``<tag>.held<S>`` before
step S and waits for ``<tag>.go<S>``; ``--die-in-round S`` SIGKILLs itself inside the
round of step S, after the quorum and before the all-reduce. Every wait has a deadline.

``--hook ft``: ``integrations.torchft.allreduce_hook`` + ``FaultTolerantAveraging``.
``--hook stock``: the stock ``hooks.allreduce_hook`` on torchft's process group after
``pg.register(...)``, with the quorum and the commit called here by hand.
"""
import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddp_avg_hooks as dah
from ddp_avg_hooks.integrations import torchft as ft


def wait_for(path: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {path} after {deadline_s} s")
        time.sleep(0.02)


def flat(model) -> list[float]:
    return torch.nn.utils.parameters_to_vector(model.parameters()).tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rid", type=int, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--period", type=int, default=2)
    p.add_argument("--hold-at", default="")
    p.add_argument("--die-in-round", type=int, default=-1)
    p.add_argument("--wait-to-begin", action="store_true",
                   help="after the imports, wait for <tag>.begin before making the Manager")
    p.add_argument("--hook", choices=("ft", "stock"), default="ft")
    p.add_argument("--timeout", type=float, default=5.0)
    a = p.parse_args()
    holds = {int(s) for s in a.hold_at.split(",") if s}
    timeout = timedelta(seconds=a.timeout)
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every replica starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # this replica group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torchft import Manager, ProcessGroupGloo

    if a.wait_to_begin:
        wait_for(os.path.join(a.dir, f"{a.tag}.begin"), 90)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg, min_replica_size=1, use_async_quorum=False, init_sync=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        timeout=timeout, quorum_timeout=timedelta(seconds=20), connect_timeout=timeout,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=a.lighthouse, replica_id=f"replica_{a.rid}", hostname="127.0.0.1")
    ddp = DistributedDataParallel(model)
    if a.hook == "ft":
        handle = dah.register_averaging_hook(ddp, ft.allreduce_hook, ft.TorchftState(manager),
                                             period=a.period)
        averaging = ft.FaultTolerantAveraging(manager, handle)
    else:
        handle = None
    if a.die_in_round >= 0:
        start_quorum = manager.start_quorum

        def start_quorum_then_die(*args, **kw):
            start_quorum(*args, **kw)
            if step == a.die_in_round:
                os.kill(os.getpid(), signal.SIGKILL)
        manager.start_quorum = start_quorum_then_die

    log = open(os.path.join(a.dir, f"{a.tag}.jsonl"), "a", buffering=1)
    log.write(json.dumps(dict(due=False, ready=time.time())) + "\n")
    open(os.path.join(a.dir, f"{a.tag}.ready"), "w").close()
    wait_for(os.path.join(a.dir, "start"), 60)
    step = 0
    while step < a.steps:
        if step in holds:
            open(os.path.join(a.dir, f"{a.tag}.held{step}"), "w").close()
            wait_for(os.path.join(a.dir, f"{a.tag}.go{step}"), 60)
        gen = torch.Generator().manual_seed(1000 * a.rid + step)  # each replica: its own data
        x = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x[:, :2].sin()).backward()
        opt.step()
        pre = flat(model)
        if a.hook == "ft":
            due = handle.is_averaging_step()
            committed = averaging.step()
            # the round's step: this replica's counter, or a peer's if it healed in the quorum
            rec = dict(step=handle.step_count - 1, own_step=step, due=due, committed=committed,
                       participants=averaging.participants if due else 0, pre=pre,
                       discarded=averaging.discarded)
            step = handle.step_count
        else:
            due = step % a.period == 0
            world = None
            if due:
                manager.start_quorum()
                if handle is None:  # registered once the first quorum configured the group
                    group = pg.register(f"dah_{a.rid}")
                    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, group,
                                                         period=a.period,
                                                         process_group=dist.group.WORLD)
                world = dist.get_world_size(group)
            if handle is not None:
                handle.step()
            committed = bool(due and manager.should_commit())
            rec = dict(step=step, due=due, committed=committed,
                       participants=manager.num_participants() if due else 0,
                       world_size=world, pre=pre)
            step += 1
        rec["post"], rec["time"] = flat(model), time.time()
        log.write(json.dumps(rec) + "\n")
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # no teardown of gloo state at interpreter exit


if __name__ == "__main__":
    main()
