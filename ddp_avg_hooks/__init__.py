"""ddp_avg_hooks: local SGD for PyTorch DDP."""
