"""What the integrations share: one gradient comm hook per DDP model, model checks, and
each rank's part of a framework checkpoint."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import grad_hooks
from .._checks import check_bool
from ..options import AveragingOptions
from ..protocol import hook_spec
from ..trees import map_tensors


def check_arguments(owner: str, hook, state, flags: dict, *, trainer_optimizer: bool,
                    **options) -> None:
    """Refuse at construction what ``register_averaging_hook`` would refuse in these
    arguments, naming ``owner``: an integration registers when training starts, and with
    one process not at all, so a mistake would otherwise wait for the distributed run.
    ``flags`` are the integration's own yes/no settings; ``trainer_optimizer``: the
    framework passes its optimizer then (checked here with a stand-in)."""
    if trainer_optimizer:
        options["optimizer"] = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    if not callable(hook):
        raise TypeError(f"{owner}: hook must be an averaging hook function (e.g. "
                        f"ddp_avg_hooks.hooks.allreduce_hook), got {type(hook).__name__}")
    for name, value in flags.items():
        check_bool(name, value, owner=owner)
    try:
        AveragingOptions.from_call(**options)
        hook_spec(hook).validate(state)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{owner}: {str(exc).removeprefix('register_averaging_hook: ')}"
                        ) from exc


def find_ddp(model) -> DistributedDataParallel | None:
    """``model`` itself, or the DDP inside ``torch.compile(ddp)``; ``None`` if neither."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DistributedDataParallel) else None


class GradSync:
    """The state of the one ``local_sgd_grad_hook`` an integration registers on a DDP model.

    DDP takes one comm hook per model, for its lifetime, while a framework may register an
    averaging hook several times on that model (``fit`` twice, a ``with`` block per
    phase). So the comm hook reads the current handle through this object: with a handle
    gradients follow its warm-up; with none (before, between and after registrations)
    they are averaged every step, as plain DDP does.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.handle = None
        self.grad_process_group = getattr(ddp, "process_group", None) or dist.group.WORLD

    @property
    def in_warmup(self) -> bool:
        return self.handle is None or self.handle.in_warmup

    @property
    def reducer_switch(self):
        """The current handle's :class:`~ddp_avg_hooks.grad_hooks.ReducerSwitch` (``None``
        without a handle)."""
        return None if self.handle is None else getattr(self.handle, "reducer_switch", None)

    def point_at(self, handle) -> None:
        """Follow ``handle`` from now on (``None``: average every step); the reducer the
        previous handle turned off runs again, since the next one may be in its warm-up."""
        if self.reducer_switch is not None and handle is not self.handle:
            self.reducer_switch.release()
        self.handle = handle

    @classmethod
    def attach(cls, ddp: DistributedDataParallel, handle) -> "GradSync":
        """Point ``ddp``'s gradient hook at ``handle``, registering the hook the first time."""
        sync = getattr(ddp, "_dah_grad_sync", None)
        if sync is None:
            sync = cls(ddp)
            ddp.register_comm_hook(sync, grad_hooks.local_sgd_grad_hook)
            ddp._dah_grad_sync = sync
        sync.point_at(handle)
        return sync


def detach(ddp: DistributedDataParallel | None) -> None:
    """Gradients of ``ddp`` are averaged every step again (no-op if nothing was attached)."""
    sync = getattr(ddp, "_dah_grad_sync", None)
    if sync is not None:
        sync.point_at(None)


def to_cpu(obj):
    """``obj`` with every tensor moved to the CPU (for ``all_gather_object``)."""
    return map_tensors(lambda t: t.detach().cpu(), obj)


def rank_state(module, optimizers, handle_state: dict | None) -> dict:
    """This rank's part of a framework checkpoint, on the CPU: its model, its optimizers'
    states and its handle's (``None`` where no handle is registered). Frameworks save rank
    0's model and optimizer only, but after the warm-up each replica has its own parameters
    and momentum until the next round."""
    return to_cpu({"format": 1, "world_size": world_size(), "model": module.state_dict(),
                   "optimizers": [opt.state_dict() for opt in optimizers],
                   "averaging": handle_state})


def write_rank_state(path: str, module, optimizers, handle_state: dict | None) -> None:
    """Write :func:`rank_state` to ``path`` whole or not at all (a temporary file, then a
    rename), making its folder if needed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(rank_state(module, optimizers, handle_state), tmp)
    os.replace(tmp, path)


def read_rank_state(path: str) -> tuple[dict | None, str | None]:
    """This rank's file from :func:`write_rank_state`, and what keeps it from loading into
    this run (``None`` if nothing): a missing file, another number of processes."""
    if not os.path.isfile(path):
        return None, f"{path} does not exist"
    saved = torch.load(path, weights_only=True)
    try:
        check_rank_state(saved, path)
    except ValueError as exc:
        return saved, str(exc)
    return saved, None


def refuse_together(problem: str | None, group, what: str, advice: str) -> None:
    """Raise ``RuntimeError`` on every rank of ``group`` if any rank has a ``problem``,
    naming each such rank's, so that no rank goes on while another one stopped
    (collective: one ``all_gather_object``)."""
    problems: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        raise RuntimeError(f"{what}: " + "; ".join(f"rank {r}: {p}"
                                                   for r, p in enumerate(problems) if p)
                           + ". " + advice)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_rank_state(saved: dict, where: str) -> None:
    """Raise ``ValueError`` if ``saved`` (from :func:`rank_state`) is not of this run's size."""
    if saved.get("world_size") != world_size():
        raise ValueError(
            f"{where}: the averaging state was saved by {saved.get('world_size')} processes and "
            f"this run has {world_size()}: each rank's state (parameters, momentum, error "
            "feedback) is its own; resume with the same number of processes")


@torch.no_grad()
def load_rank_state(saved: dict, module, optimizers, handle) -> None:
    """Put :func:`rank_state` back: checked first (``handle.check_state_dict``), then the
    model in place, the optimizers, the handle (``None``: a state saved without one)."""
    if handle is not None:
        handle.check_state_dict(saved["averaging"])
    if len(saved["optimizers"]) != len(optimizers):
        raise ValueError(f"the checkpoint holds {len(saved['optimizers'])} optimizers' states, "
                         f"this run has {len(optimizers)}")
    for name, tensor in module.state_dict().items():
        tensor.copy_(saved["model"][name])
    for opt, state in zip(optimizers, saved["optimizers"]):
        opt.load_state_dict(state)
    if handle is not None:
        handle.load_state_dict(saved["averaging"])


#: why a framework's sharded training cannot run local SGD, and what to do instead
SHARDED_REFUSAL = (
    "{what} shards the model over every data-parallel rank (one replica group: nothing to "
    "average) or, as native HSDP, all-reduces gradients across replica groups at every "
    "step, which local SGD replaces; and its sharded checkpoints (torch.distributed."
    "checkpoint) keep one copy of each shard across data-parallel ranks, so the replicas' "
    "own states would be lost at a resume. Local SGD over shards needs a 1-D shard mesh "
    "per replica group and per-rank checkpoints: fully_shard the model yourself and "
    "register it with ddp_avg_hooks.register_averaging_hook under torchrun, with "
    "ddp_avg_hooks.checkpoint.RoundCheckpointer (see examples/fsdp2.py)"
)
