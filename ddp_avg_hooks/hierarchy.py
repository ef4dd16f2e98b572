"""Hierarchical averaging: process groups for ``(nodes, ranks per node)``.

Links inside a node (NVLink, shared memory) are much faster than links between nodes,
so average often and exactly inside a node and rarely, or compressed, across nodes.
That is two registrations on one model, each on its own group with its own period
and hook; :func:`node_groups` builds the groups. The recipe
(``ranks_per_node=8``: exact every 2 steps within a node, PowerSGD every 16 across
all ranks)::

    groups = dah.hierarchy.node_groups(ranks_per_node=8)   # collective: every rank calls it
    intra = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, groups.intra,
                                        period=2, optimizer=opt)
    inter = dah.register_averaging_hook(ddp, dah.hooks.powersgd_hook,
                                        dah.hooks.PowerSGDState(matrix_approximation_rank=4),
                                        period=16, warmup_steps=warmup, optimizer=opt)
    ddp.register_comm_hook(inter, dah.grad_hooks.local_sgd_grad_hook)

* Each handle counts its own bytes: ``intra.stats.bytes_sent`` is traffic inside the
  node, ``inter.stats.bytes_sent`` the global rounds (the traffic that crosses nodes).
* At a step where both average (every 16th here), the handles run in registration
  order: the node round first, then the global round, whose result every rank shares.
  Both are correct in either order (a round of identical replicas changes nothing);
  a period for the node round that skips those steps would save its bytes there.
* The global round runs on the default group, so it averages *all* ranks, whatever
  the node rounds did in between: ``new = mean of every rank's parameters`` for the
  exact hook. Anchor-based hooks (fp16, PowerSGD) keep one anchor per registration,
  set at that registration's rounds and identical across its group, so their deltas
  include the other registration's updates and stay correct.
* DDP takes one comm hook: register ``local_sgd_grad_hook`` with the handle whose
  warm-up should drive gradient averaging (the global one), and give the node
  registration the same ``warmup_steps`` if it should not average during warm-up.
* Ranks are laid out node by node, as ``torchrun`` numbers them: node ``n`` holds
  ranks ``n * ranks_per_node ... (n + 1) * ranks_per_node - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ._checks import check_int


@dataclass(frozen=True)
class NodeGroups:
    """The process groups :func:`node_groups` built, seen from this rank.

    Attributes:
        nodes: number of nodes (``world_size // ranks_per_node``).
        ranks_per_node: ranks on each node.
        node: this rank's node, ``rank // ranks_per_node``.
        local_rank: this rank's position on its node, ``rank % ranks_per_node``.
        intra: the group of this rank's node (pass it as the state of an exact hook).
        intra_groups: every node's group, by node; on this rank, those of other nodes
            are ``new_group``'s non-member marker.
        cross: the ranks with this rank's ``local_rank``, one per node (``None`` when
            built with ``cross=False``).
        cross_groups: every such group, by local rank (empty with ``cross=False``).

    Example:
        >>> import torch.distributed as dist
        >>> from ddp_avg_hooks.hierarchy import node_groups
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> g = node_groups(ranks_per_node=1)
        >>> g.nodes, g.node, g.local_rank, g.ranks_of_node(0), dist.get_world_size(g.intra)
        (1, 0, 0, [0], 1)
        >>> dist.destroy_process_group()
    """

    nodes: int
    ranks_per_node: int
    node: int
    local_rank: int
    intra: dist.ProcessGroup
    intra_groups: tuple
    cross: dist.ProcessGroup | None
    cross_groups: tuple

    def ranks_of_node(self, node: int) -> list[int]:
        """The global ranks on ``node``."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    @property
    def leaders(self) -> dist.ProcessGroup | None:
        """The group of each node's first rank (``cross_groups[0]``), or ``None``."""
        return self.cross_groups[0] if self.cross_groups else None


def node_groups(
    ranks_per_node: int,
    *,
    cross: bool = True,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> NodeGroups:
    """Build the process groups of ``world_size // ranks_per_node`` nodes.

    Collective: every rank of the default group must call it, with the same
    arguments, because ``dist.new_group`` must be called by every rank for every group
    in the same order. It creates one group per node (in node order), then, with
    ``cross=True``, one group per local rank across the nodes (in local-rank order).

    Args:
        ranks_per_node: ranks on each node; must divide the world size.
        cross: also build the groups across nodes (``NodeGroups.cross``, ``.leaders``).
        backend: backend of the new groups (default: the default group's).
        timeout: timeout of the new groups (default: the default group's).

    Returns:
        A :class:`NodeGroups`.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 8))
        >>> groups = dah.hierarchy.node_groups(ranks_per_node=1)
        >>> intra = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, groups.intra,
        ...                                     period=2)
        >>> inter = dah.register_averaging_hook(ddp, dah.hooks.powersgd_hook,
        ...                                     dah.hooks.PowerSGDState(), period=4)
        >>> for _ in range(8):
        ...     _ = intra.step(), inter.step()
        >>> # bytes: 4 rounds x 136 numbers x 4 B; 2 rounds x (8 + 16 + 8) numbers x 4 B
        >>> intra.stats.rounds, inter.stats.rounds, intra.stats.bytes_sent, inter.stats.bytes_sent
        (4, 2, 2176, 256)
        >>> intra.remove(); inter.remove(); dist.destroy_process_group()
    """
    if not dist.is_initialized():
        raise RuntimeError("node_groups: call dist.init_process_group first")
    check_int("ranks_per_node", ranks_per_node, 1, owner="node_groups")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"node_groups: ranks_per_node={ranks_per_node} must be >= 1 and divide the "
            f"world size {world_size} (nodes hold the same number of ranks)"
        )
    nodes = world_size // ranks_per_node
    options = {"backend": backend, "timeout": timeout}
    intra_groups = tuple(
        dist.new_group(list(range(n * ranks_per_node, (n + 1) * ranks_per_node)), **options)
        for n in range(nodes)
    )
    cross_groups = ()
    if cross:
        cross_groups = tuple(
            dist.new_group([n * ranks_per_node + local for n in range(nodes)], **options)
            for local in range(ranks_per_node)
        )
    node, local_rank = divmod(rank, ranks_per_node)
    return NodeGroups(
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        node=node,
        local_rank=local_rank,
        intra=intra_groups[node],
        intra_groups=intra_groups,
        cross=cross_groups[local_rank] if cross else None,
        cross_groups=cross_groups,
    )
