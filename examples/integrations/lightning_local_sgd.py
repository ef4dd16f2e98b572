"""Local SGD under Lightning: ``AveragingCallback`` on ``Trainer(strategy="ddp")``.

    torchrun --nproc-per-node 2 examples/integrations/lightning_local_sgd.py
    python examples/integrations/lightning_local_sgd.py   # Lightning starts the 2nd process

Two CPU processes fit a small MLP to a synthetic regression (each rank reads its half
of the data). DDP averages gradients for the first 8 optimizer steps; after that they
stay local and ``hooks.allreduce_hook`` averages the parameters every 8 steps.
"""
import argparse

import lightning as L
import torch
import torch.nn.functional as F

import ddp_avg_hooks as dah
from _agree import spread
from ddp_avg_hooks.integrations.lightning import AveragingCallback


class Regression(L.LightningModule):
    def __init__(self, lr=0.05, momentum=0.9):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def data(n=1024, batch_size=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4]).sum(1, keepdim=True)
    # Lightning adds a DistributedSampler (shuffled each epoch): each rank reads its own half
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def fit(callbacks=(), strategy="ddp", max_steps=41, ckpt_path=None, **trainer_kw):
    model = Regression()
    kw = dict(logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                        callbacks=list(callbacks), **{**kw, **trainer_kw})
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer, model


def main():
    callback = AveragingCallback(dah.hooks.allreduce_hook, period=8, warmup_steps=8)
    trainer, model = fit([callback])
    x, y = next(iter(data(256, 256)))
    loss = F.mse_loss(model.net(x), y).item()
    gap = spread(model)
    if trainer.is_global_zero:
        print(f"lightning: {trainer.global_step} steps, {callback.stats.rounds} rounds (the last "
              f"at the end of fit), loss {loss:.4f}; replicas differ by {gap:.1e}")
    assert gap == 0.0, "replicas disagree after averaging"
    if trainer.is_global_zero:
        print("lightning: replicas agree")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
