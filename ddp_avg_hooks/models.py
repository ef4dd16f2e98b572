"""What a rank averages: the parameters of a DDP model, or its local shards of an FSDP2 one.

:func:`averaged_model` turns what a user registers into an :class:`AveragedModel`:

* ``DistributedDataParallel`` (or ``torch.compile`` of one): the trainable parameters
  DDP does not ignore.
* An FSDP2 module (the root that ``fully_shard`` returned, an ``FSDPModule``) on a 1-D
  mesh: each rank's **local shard** of every parameter (``p.to_local()``, a view of the
  sharded storage, so a round writes the shard in place). Local shards that hold no
  element (a parameter with fewer rows than shards leaves the last ranks empty) are left
  out; the same ranks of the other replicas hold the same empty shards. The averaging
  group is the *replicate* group: the ranks that hold the same shard in each replica
  group (``mesh["replicate"].get_group()`` when the mesh is built as
  ``init_device_mesh(..., (replicas, shards), mesh_dim_names=("replicate", "shard"))``
  and the model is sharded over ``mesh["shard"]``).

Refused, with what to do instead: a model of another kind, FSDP2 over a 2-D mesh
(native HSDP: it averages gradients across replicas at every step, which is what local
SGD stops; shard over the 1-D ``mesh["shard"]`` instead), FSDP1
(``FullyShardedDataParallel``: port it to ``fully_shard``), and a bare module under
``torch.compile``.

Example:
    >>> import torch, torch.distributed as dist
    >>> from ddp_avg_hooks.models import averaged_model
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> m = averaged_model(ddp)
    >>> m.sharded, [tuple(p.shape) for p in m.params]
    (False, [(2, 4), (2,)])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["AveragedModel", "averaged_model", "fsdp_modules", "is_fsdp2", "local_tensor"]

try:  # torch >= 2.6 exports FSDP2 here
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - an older torch: no FSDP2
    FSDPModule = None

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None

_RECIPE = (
    "build one 1-D shard mesh per replica group, e.g. mesh = init_device_mesh(device, "
    "(replicas, shards), mesh_dim_names=('replicate', 'shard')); fully_shard(model, "
    "mesh=mesh['shard']); then register with the replicate group as the hook's state "
    "(mesh['replicate'].get_group())"
)


def is_fsdp2(model) -> bool:
    """Whether ``model`` is an FSDP2 module (what ``fully_shard`` returns)."""
    return FSDPModule is not None and isinstance(model, FSDPModule)


def fsdp_modules(model: torch.nn.Module) -> list:
    """Every FSDP2 module inside ``model`` (itself included), in ``modules()`` order."""
    return [m for m in model.modules() if is_fsdp2(m)]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local part: ``t.to_local()`` for a DTensor (a view of its storage), else ``t``."""
    if DTensor is not None and isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


@dataclasses.dataclass
class AveragedModel:
    """What a registration averages on this rank.

    Attributes:
        module: the module itself (``ddp.module`` for DDP, the FSDP2 root).
        names: the averaged parameters' names, in ``module.named_parameters()`` order.
        keys: the parameters themselves (the optimizer's state is keyed by them).
        params: the tensors the buckets hold: the parameters, or their local shards.
        sharded: an FSDP2 model.
        grad_process_group: the group DDP averages gradients over (``None`` for FSDP2).
        broadcast_buffers: DDP broadcasts rank 0's buffers at each forward.
        ignored: the parameter and buffer names DDP ignores.
        replica_group: with FSDP2, the group of the shard mesh: this rank's replica group,
            whose ranks step together (``None`` for DDP).
        sharded_params: with FSDP2, every trainable ``(name, parameter)``, empty local
            shards included.
        ddp: a weak reference to the DistributedDataParallel wrapper (``None`` for
            FSDP2): DDP's reducer holds the comm hook's state, often the handle.
    """

    module: torch.nn.Module
    names: list[str]
    keys: list[torch.Tensor]
    params: list[torch.Tensor]
    sharded: bool = False
    grad_process_group: object = None
    broadcast_buffers: bool = False
    ignored: frozenset = frozenset()
    replica_group: object = None
    sharded_params: list = dataclasses.field(default_factory=list)
    ddp: object = None

    def shards(self) -> list[tuple]:
        """Per trainable parameter of an FSDP2 model, where its local shard sits:
        ``(name, global shape, placements, mesh size, this rank's mesh coordinate)``.
        Ranks that average together must hold the same shards, so these must agree
        across the averaging group (``[]`` for DDP)."""
        out = []
        for name, key in self.sharded_params:
            mesh = key.device_mesh
            out.append((name, tuple(key.shape), tuple(str(p) for p in key.placements),
                        mesh.size(), mesh.get_local_rank()))
        return out

    @functools.cached_property
    def _averaged_ids(self) -> frozenset:
        return frozenset([id(p) for p in self.keys] + [id(p) for _, p in self.sharded_params])

    def averages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the averaged parameters (with FSDP2, the sharded
        parameter itself, empty local shard or not)."""
        return id(param) in self._averaged_ids

    def check_optimizer(self, optimizer, who: str) -> None:
        """Raise ``ValueError`` unless ``optimizer`` steps at least one of the averaged
        parameters: rounds counted by another model's optimizer would follow its steps,
        and ``optimizer_state`` would find no state of these parameters."""
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(
                f"{who}: expected an optimizer (a torch.optim.Optimizer), got "
                f"{type(optimizer).__name__}; pass the optimizer that trains this model")
        if any(self.averages(p) for g in optimizer.param_groups for p in g["params"]):
            return
        raise ValueError(
            f"{who}: the optimizer ({type(optimizer).__name__}) holds none of the averaged "
            f"model's trainable parameters ({', '.join(self.names[:3])}"
            f"{', ...' if len(self.names) > 3 else ''}); pass the optimizer that trains "
            "this model, built over model.parameters()")

    def buffers(self) -> list[torch.Tensor]:
        """The floating-point buffers (averaged by ``average_buffers=True``)."""
        return [local_tensor(b) for name, b in self.module.named_buffers()
                if b.is_floating_point() and name not in self.ignored]


def _unwrap_compiled(model):
    inner = getattr(model, "_orig_mod", None)
    if inner is None or not isinstance(model, torch.nn.Module):
        return model
    if isinstance(inner, DistributedDataParallel) or is_fsdp2(inner):
        return inner
    raise TypeError(
        "register_averaging_hook: ddp_model is torch.compile of a "
        f"{type(inner).__name__}, not of a DistributedDataParallel; pass "
        "torch.compile(DistributedDataParallel(model)) or "
        "DistributedDataParallel(torch.compile(model))"
    )


def _check_fsdp2_mesh(name: str, p: torch.Tensor) -> None:
    if DTensor is None or not isinstance(p, DTensor):
        raise TypeError(
            f"register_averaging_hook: parameter {name!r} of the FSDP2 module is not "
            f"sharded (a {type(p).__name__}, not a DTensor); apply fully_shard to every "
            "module that holds parameters, or to the root"
        )
    if p.device_mesh.ndim != 1:
        raise ValueError(
            f"register_averaging_hook: parameter {name!r} is sharded over a "
            f"{p.device_mesh.ndim}-D mesh {p.placements}: native HSDP all-reduces "
            "gradients across replicas at every step, which local SGD replaces; "
            + _RECIPE
        )


def averaged_model(model) -> AveragedModel:
    """The :class:`AveragedModel` of ``model`` (a DDP model or an FSDP2 root); refuses
    other kinds with what to pass instead."""
    model = _unwrap_compiled(model)
    if type(model).__name__ == "FullyShardedDataParallel":  # FSDP1, without importing it
        raise TypeError(
            "register_averaging_hook: FSDP1 (FullyShardedDataParallel) is not supported: "
            "its flat parameters have no per-parameter local shard to average. Use FSDP2: "
            + _RECIPE
        )
    if isinstance(model, DistributedDataParallel):
        ignored = frozenset(getattr(model, "parameters_to_ignore", set()) or set())
        named = [(n, p) for n, p in model.module.named_parameters()
                 if p.requires_grad and n not in ignored]
        if not named:
            raise ValueError(
                "register_averaging_hook: the model has no trainable parameters to average "
                "(all have requires_grad=False or are ignored by DDP)"
            )
        return AveragedModel(
            module=model.module, names=[n for n, _ in named], keys=[p for _, p in named],
            params=[p for _, p in named],
            grad_process_group=getattr(model, "process_group", None),
            broadcast_buffers=bool(getattr(model, "broadcast_buffers", False)),
            ignored=ignored, ddp=weakref.ref(model))
    if is_fsdp2(model):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "register_averaging_hook: the model has no trainable parameters to average "
                "(all have requires_grad=False)"
            )
        for name, p in named:
            _check_fsdp2_mesh(name, p)
        kept = [(n, p, local_tensor(p)) for n, p in named]
        kept = [(n, p, t) for n, p, t in kept if t.numel() > 0]  # empty shards: nothing here
        return AveragedModel(module=model, names=[n for n, _, _ in kept],
                             keys=[p for _, p, _ in kept], params=[t for _, _, t in kept],
                             sharded=True, replica_group=named[0][1].device_mesh.get_group(),
                             sharded_params=named)
    raise TypeError(
        "register_averaging_hook: ddp_model must be a "
        "torch.nn.parallel.DistributedDataParallel or an FSDP2 module (what fully_shard "
        f"returns), got {type(model).__name__}; wrap the model with "
        "DistributedDataParallel(model) or fully_shard(model, mesh=...) first"
    )
