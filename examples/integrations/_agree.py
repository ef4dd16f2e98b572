"""What the integration examples share: how far apart the replicas are."""
import torch
import torch.distributed as dist


def spread(model) -> float:
    """Largest difference between the ranks' copies of any parameter (collective)."""
    v = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    hi, lo = v.clone(), v.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()
