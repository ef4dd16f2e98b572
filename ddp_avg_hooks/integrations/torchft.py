"""torchft: averaging rounds that survive replicas failing, leaving and rejoining.

`torchft <https://github.com/pytorch/torchft>`_ runs each *replica group* (the ranks
that fail and recover together) under a ``torchft.Manager``: before a step the Manager
asks a lighthouse for a quorum of the live replica groups and rebuilds its process group
for it; a replica group that is behind heals from a peer (the Manager's checkpoint
transport sends the state its ``state_dict`` functions return); after the step
``manager.should_commit()`` says whether the step's collectives all succeeded.

Here the averaging runs across replica groups, through the Manager:

- :func:`allreduce_hook` with a :class:`TorchftState`: the exact average, by
  ``manager.allreduce``: a sum over the current quorum divided by
  ``manager.num_participants()``, the replicas that contribute this round (a replica
  that is still healing sends zeros and is not counted). A failed collective is
  reported to the Manager instead of raising.
- :class:`FaultTolerantAveraging` around the handle: ``step()`` starts a quorum before
  each round (reconfiguring the process group, healing this replica if it is behind),
  runs the round, and keeps its result only if ``manager.should_commit()`` agrees; a
  discarded round leaves every parameter as it was before the round. It registers the
  handle's ``state_dict`` with the Manager, so a healing replica gets the counter too.

Register the hook with the replica group's own (default) process group as the group
that agrees on the settings; with one process per replica group that is a world of one::

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), use_async_quorum=False,
                              init_sync=False, load_state_dict=..., state_dict=...,
                              min_replica_size=1, ...)
    ddp = DistributedDataParallel(model)
    handle = dah.register_averaging_hook(ddp, ft.allreduce_hook, ft.TorchftState(manager),
                                         period=8)
    averaging = ft.FaultTolerantAveraging(manager, handle)
    for x, y in loader:
        opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
        averaging.step()             # instead of handle.step()

Why not a stock hook on torchft's process group: ``dist.get_rank`` (hence every built-in
hook) rejects an unregistered group (``Group ProcessGroupGloo(...) is not registered``);
after ``pg.register(name)`` the stock :func:`~ddp_avg_hooks.hooks.allreduce_hook` does
average right, since ``dist.get_world_size(group)`` is the torchft group's ``size()``,
the size of the last quorum, but only if a quorum was started before the round, and it
counts a healing replica (``use_async_quorum=True``) as a contributor, and a failed
collective raises out of ``handle.step()`` instead of discarding the round. Each rank is
rank 0 of such a registered group, so hooks that single out a rank do not fit it.

Only rounds the handle runs in ``step()`` are fault tolerant; ``handle.average()``
bypasses the quorum. The built-in exact hook keeps no state between rounds; a stateful
hook (error feedback, an outer optimizer) would keep what a discarded round did to its
state, so this module offers the exact average only.
"""

from __future__ import annotations

import torch

from .. import ops
from ..collectives import completed
from ..handle import AveragingHandle
from ..protocol import averaging_hook
from ..step_hooks import StepHooks

__all__ = ["TorchftState", "allreduce_hook", "FaultTolerantAveraging"]


class TorchftState:
    """State of :func:`allreduce_hook`: the replica group's ``torchft.Manager``.

    It names no process group, so the registration's settings are agreed on the default
    group (the ranks of this replica group), not across replica groups, which come and
    go.
    """

    __slots__ = ("manager",)

    def __init__(self, manager) -> None:
        for name in ("allreduce", "num_participants", "start_quorum", "should_commit"):
            if not callable(getattr(manager, name, None)):
                raise TypeError(f"TorchftState: manager must be a torchft.Manager, got "
                                f"{type(manager).__name__} (no {name}())")
        self.manager = manager


def _check_state(state) -> None:
    if not isinstance(state, TorchftState):
        raise TypeError("torchft allreduce_hook: state must be a TorchftState(manager), got "
                        f"{type(state).__name__}")


@averaging_hook(validate_state=_check_state)
def allreduce_hook(state: TorchftState, bucket) -> torch.futures.Future:
    """Average the bucket over the replicas of the Manager's current quorum.

    ``new = sum_r(params_r) / manager.num_participants()`` by ``manager.allreduce``
    (torchft's average: the sum over the quorum's process group, then the division by
    the replicas that take part this round; one that is healing contributes zeros).
    If the collective fails the Manager records the error, the future still completes,
    and :class:`FaultTolerantAveraging` discards the round. It waits for each bucket's
    all-reduce before returning (see the comment in the code).
    """
    buf = bucket.buffer()
    bucket.record_sent(buf)
    work = state.manager.allreduce(buf)  # in place, ReduceOp.AVG
    # Blocking: torchft 0.2 runs the future's callbacks (the division, the error
    # handling) correctly only once the collective is done. Building them earlier
    # (work.synchronize() on the CPU) makes each callback see the chain's last link
    # (AssertionError in _ManagedWork._set_future_callback). So the buckets' all-reduces
    # run one after another.
    if not work.wait():  # failed: the Manager holds the error, should_commit() says no
        return completed(buf)
    return work.get_future()


class FaultTolerantAveraging:
    """Runs ``handle``'s rounds as torchft steps: quorum, round, commit.

    Args:
        manager: the replica group's ``torchft.Manager``, made with
            ``use_async_quorum=False`` (the quorum, and any healing, completes before the
            round reads the parameters) and ``init_sync=False`` (torchft's step-0 sync
            would make the first round a copy of one replica group; start every replica
            group from the same weights instead).
        handle: the :class:`~ddp_avg_hooks.AveragingHandle`, registered with
            :func:`allreduce_hook` and a :class:`TorchftState` of the same manager.
        key: the name the handle's state is registered under with the manager
            (``manager.register_state_dict_fn``); the model and optimizer are the
            manager's own ``state_dict`` / ``load_state_dict`` functions.

    ``step()`` replaces ``handle.step()`` and returns True when a round ran and was
    committed; a handle registered with ``optimizer=`` gets it after every optimizer
    step instead (this object takes over the optimizer's step hook, so every round runs
    inside a quorum). ``committed`` and ``discarded`` count the rounds; ``participants``
    is ``manager.num_participants()`` of the last round, and ``rounds`` holds one record
    per round: ``{"step", "participants", "committed"}``.
    """

    def __init__(self, manager, handle, *, key: str = "ddp_avg_hooks") -> None:
        if not isinstance(handle, AveragingHandle):
            raise TypeError(
                "FaultTolerantAveraging(manager, handle): handle must be the AveragingHandle "
                f"register_averaging_hook returned, got {type(handle).__name__}")
        state = handle.state
        if not isinstance(state, TorchftState) or state.manager is not manager:
            raise ValueError("FaultTolerantAveraging: register the handle with "
                             "ddp_avg_hooks.integrations.torchft.allreduce_hook and "
                             "TorchftState(manager) of this manager")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("FaultTolerantAveraging: make the Manager with use_async_quorum=False "
                             "(a round must not read parameters while this replica heals)")
        if getattr(manager, "_init_sync", False):
            raise ValueError(
                "FaultTolerantAveraging: make the Manager with init_sync=False. With "
                "init_sync=True torchft gives every replica group one replica group's model "
                "and optimizer at its first quorum, which here is the first averaging round: "
                "that round would copy one replica instead of averaging, discarding the "
                "others' local steps. Build the model after the same torch.manual_seed in "
                "every replica group (or load the same weights); replicas that start apart "
                "meet at the first round, which averages them")
        if handle.period is None:
            raise ValueError("FaultTolerantAveraging: rounds must be counted in steps "
                             "(a time-based period decides a round on each rank's own clock)")
        self.manager, self.handle = manager, handle
        self.committed = self.discarded = 0
        self.participants = 0
        self.rounds: list[dict] = []
        self._step_hooks = None
        if handle.attached_optimizer:  # the optimizer's steps come here, not to the handle
            handle.detach_optimizer()
            self._step_hooks = StepHooks(handle.options.optimizer, self.step)
        manager.register_state_dict_fn(key, handle.load_state_dict, handle.state_dict)

    def step(self) -> bool:
        """``handle.step()`` inside a torchft step when it averages (collective then)."""
        if not self.handle.is_averaging_step():
            self.handle.step()
            return False
        # reconfigures the process group for the live replicas; a replica that is behind
        # loads a peer's state here, this handle's counter included
        self.manager.start_quorum()
        if not self.handle.is_averaging_step():  # only if the healthy peers disagree
            raise RuntimeError("FaultTolerantAveraging: after the quorum this replica's "
                               f"step {self.handle.step_count} is no averaging step")
        self.participants = self.manager.num_participants()
        at = self.handle.step_count
        saved = [ops.flatten(b.parameters(), torch.empty(b.numel(), dtype=b.dtype, device=b.device))
                 for b in self.handle.buckets]
        averaged = self.handle.step()
        committed = self.manager.should_commit()
        self.rounds.append({"step": at, "participants": self.participants,
                            "committed": committed})
        if committed:
            self.committed += 1
            return averaged
        self.discarded += 1
        with torch.no_grad():  # the round failed somewhere: undo what it wrote
            for bucket, flat in zip(self.handle.buckets, saved):
                ops.unflatten_(flat, bucket.parameters())
        return False
