"""Local SGD with Accelerate: ``LocalSGD`` as in ``accelerate.local_sgd``, with this library's
hooks.

    torchrun --nproc-per-node 2 examples/integrations/accelerate_local_sgd.py

Two CPU processes fit a small MLP to a synthetic regression, accumulating gradients over
2 micro-batches. Gradients are averaged for the first 4 optimizer steps; after that they
stay local and the fp16-compressed deltas of the parameters are averaged every 8 steps.
"""
import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import ddp_avg_hooks as dah
from _agree import spread
from ddp_avg_hooks.integrations.accelerate import LocalSGD


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def batches(n=2048, batch_size=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4]).sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def main():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    # with one process LocalSGD does nothing (as accelerate's does): nothing to show then
    assert accelerator.num_processes > 1, "run with: torchrun --nproc-per-node 2 " + __file__
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # prepare() wraps the model in DistributedDataParallel and gives each rank its shard
    model, opt, loader = accelerator.prepare(model, opt, batches())
    with LocalSGD(accelerator, model, local_sgd_steps=8, hook=dah.hooks.fp16_compress_hook,
                  warmup_steps=4) as local_sgd:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()  # a real step every 2nd micro-batch only
                opt.zero_grad()
                local_sgd.step()
        handle = local_sgd.handle
        steps, rounds = handle.step_count, handle.stats.rounds
    gap = spread(model)  # leaving the block averaged once more
    accelerator.print(f"accelerate: {local_sgd.num_steps} micro-batches, {steps} optimizer steps, "
                      f"{rounds} rounds + 1 on leaving, loss {loss.item():.4f}; "
                      f"replicas differ by {gap:.1e}")
    assert gap == 0.0, "replicas disagree after averaging"
    accelerator.print("accelerate: replicas agree")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
