"""Run under torchrun (2 ranks) by test_integrations.py: the Lightning example, then parity
with Lightning's own post-local-SGD averaging, another hook, and checkpoint round trips.

Usage: torchrun --standalone --nproc-per-node 2 tests/_lightning_checks.py CKPT_DIR
Rank 0 prints one ``check <name>: ...`` line per check; any failed check raises.
"""
import glob
import os
import sys

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
from _helpers import exit_cleanly, report  # noqa: E402
import lightning_local_sgd as ex  # noqa: E402

import ddp_avg_hooks as dah  # noqa: E402
from ddp_avg_hooks.integrations.lightning import AveragingCallback  # noqa: E402

W, N, STEPS = 5, 4, 23  # rounds after steps 6, 10, 14, 18, 22; step 23 is local again


class CommHookOnCPU(DDPStrategy):
    """Lightning's DDPStrategy, registering its ``ddp_comm_hook`` on CPU as it does on CUDA
    (``DDPStrategy._register_ddp_hooks`` skips it unless the root device is CUDA)."""

    def _register_ddp_hooks(self):
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook,
                                ddp_comm_wrapper=self._ddp_comm_wrapper)


def lightnings_own(strategy_cls):
    state = post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=W,
                                         post_local_gradient_allreduce=False)
    strategy = strategy_cls(ddp_comm_state=state, ddp_comm_hook=post_local.post_localSGD_hook,
                            model_averaging_period=N)
    return ex.fit(strategy=strategy, max_steps=STEPS)[1]


def ours(hook=dah.hooks.allreduce_hook, others=(), **kw):
    cb = AveragingCallback(hook, period=N, warmup_steps=W, average_at_end=False, **kw)
    return ex.fit([cb, *others], max_steps=STEPS)[1], cb


class SyncFlags(Callback):
    """DDP's ``require_backward_grad_sync`` after each training batch, and the DDP model."""

    def __init__(self):
        self.flags, self.ddp = [], None

    def on_train_batch_end(self, trainer, *args):
        self.ddp = trainer.strategy.model
        self.flags.append(self.ddp.require_backward_grad_sync)


def vec(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()




def compare(name, a, b):
    diff = (a - b).abs().max().item()
    report(name, torch.equal(a, b), f"max |diff| {diff:.1e}")


def main():
    ckpt_dir = sys.argv[1]
    ex.main()

    # 1. Lightning's post-local SGD (comm hook registered as on CUDA) vs the callback
    ref = vec(lightnings_own(CommHookOnCPU))
    sync = SyncFlags()
    mine, cb = ours(others=[sync])
    compare("parity_post_local_sgd", ref, vec(mine))
    report("replicas_apart_after_local_step", ex.spread(mine) > 0, f"rounds {cb.stats.rounds}")
    # DDP's reducer runs through the warm-up, is off from the first local backward on, and
    # runs again once fit ends
    report("reducer_off_after_warmup",
           sync.flags == [True] * W + [False] * (STEPS - W) and sync.ddp.require_backward_grad_sync,
           f"require_backward_grad_sync after each batch {sync.flags}")

    # 2. Lightning as it runs on CPU (gradients averaged every step) vs grad_sync_after_warmup
    shipped = vec(lightnings_own(DDPStrategy))
    compare("parity_lightning_cpu_grad_sync", shipped, vec(ours(grad_sync_after_warmup=True)[0]))
    report("cpu_differs_from_local_sgd", not torch.equal(shipped, ref), "")

    # 3. another hook: fp16-compressed deltas; the final average makes the replicas agree
    cb = AveragingCallback(dah.hooks.fp16_compress_hook, period=N, warmup_steps=W)
    model = ex.fit([cb], max_steps=STEPS)[1]
    report("fp16_hook_replicas_agree", ex.spread(model) == 0.0,
           f"rounds {cb.stats.rounds}, {cb.stats.bytes_per_round:.0f} B/round")

    # 3b. gradient accumulation: the handle counts optimizer steps, not micro-batches
    at = []
    cb = AveragingCallback(period=N, warmup_steps=W, on_round=lambda h: at.append(h.step_count))
    trainer, model = ex.fit([cb], max_steps=10, accumulate_grad_batches=3)
    report("accumulation_rounds_at_optimizer_steps",
           at == [W, W + N, 10] and trainer.global_step == 10 and ex.spread(model) == 0.0,
           f"rounds at {at} of {trainer.global_step} optimizer steps")

    # 4. checkpoint: written by ModelCheckpoint at the end of epoch 1 (32 steps, a round),
    # resumed in a fresh trainer: the same parameters as the run that never stopped
    opts = dict(period=4, warmup_steps=3, optimizer_state="average")
    full, calls = AveragingCallback(dah.hooks.fp16_compress_hook, **opts), []
    full.state_dict = lambda sd=full.state_dict: calls.append(1) or sd()  # count the calls
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1,
                            save_on_train_epoch_end=True)
    whole = vec(ex.fit([full, saver], max_steps=-1, max_epochs=2, enable_checkpointing=True)[1])
    report("state_dict_on_every_rank", len(calls) == 2, f"state_dict calls {len(calls)}")
    path = glob.glob(os.path.join(ckpt_dir, "*step=32*.ckpt"))[0]
    saved = torch.load(path, weights_only=False)["callbacks"]["AveragingCallback"]
    mem = [next(iter(r["averaging"]["bucket_memory"][0].values()))  # fp16 residuals
           for r in saved["ranks"]]
    report("checkpoint_has_each_ranks_state",
           saved["world_size"] == 2
           and [r["averaging"]["step_count"] for r in saved["ranks"]] == [32, 32]
           and not torch.equal(mem[0], mem[1]), f"keys {sorted(saved['ranks'][0])}")
    resumed_cb = AveragingCallback(dah.hooks.fp16_compress_hook, **opts)
    resumed = vec(ex.fit([resumed_cb], max_steps=-1, max_epochs=2, ckpt_path=path)[1])
    compare("resume_matches_uninterrupted", whole, resumed)
    bad = AveragingCallback(dah.hooks.allreduce_hook, **opts)
    try:
        ex.fit([bad], max_steps=-1, max_epochs=2, ckpt_path=path)
        ok, detail = False, "no error"
    except ValueError as exc:
        ok, detail = "differs" in str(exc), str(exc)[:90]
    report("resume_with_another_hook_raises", ok, detail)
    # the same checkpoint without the callback's entry (as a run without it saves)
    bare = os.path.join(ckpt_dir, "without_callback.ckpt")
    if dist.get_rank() == 0:
        checkpoint = torch.load(path, weights_only=False)
        del checkpoint["callbacks"]["AveragingCallback"]
        torch.save(checkpoint, bare)
    dist.barrier()
    try:
        ex.fit([AveragingCallback(dah.hooks.fp16_compress_hook, **opts)], max_steps=-1,
               max_epochs=2, ckpt_path=bare)
        ok, detail = False, "no error"
    except RuntimeError as exc:
        ok, detail = "without this callback's state" in str(exc), str(exc)[:90]
    report("resume_without_the_callbacks_state_raises", ok, detail)


if __name__ == "__main__":
    main()
    exit_cleanly()
