"""Run under torchrun (2 ranks) by test_framework_resume.py: a framework's own checkpoint,
taken mid-period (or, for ``accelerate_epochs``, between two ``LocalSGD`` blocks), resumed in
fresh processes, ends where an uninterrupted run does, bit for bit.

Usage: torchrun --standalone --nproc-per-node 2 tests/_resume_checks.py FRAMEWORK PHASE DIR

FRAMEWORK is hf, accelerate, accelerate_epochs or lightning; PHASE is ``straight`` (train
to the end without stopping, checkpointing with the framework's own call at a step between
two rounds on the way, and keep every rank's result) or ``resume`` (resume that checkpoint
in these fresh processes, train to the end, compare every rank with ``straight``). Saving
changes nothing in a run, so the checkpoint is the one a run that stopped there would
leave. Rank 0 prints ``check <name>: ...`` lines.
"""
import glob
import os
import shutil
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _helpers import exit_cleanly, report  # noqa: E402

import ddp_avg_hooks as dah  # noqa: E402


def _result(module, handle_stats, steps):
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()
    return {"params": params, "steps": steps, "rounds": handle_stats.rounds,
            "bytes": handle_stats.bytes_sent}


def _finish(phase, folder, name, result):
    rank = dist.get_rank()
    path = os.path.join(folder, f"{phase}_rank{rank}.pt")
    if phase == "straight":
        torch.save(result, path)
        return
    if phase == "resume":
        straight = torch.load(os.path.join(folder, f"straight_rank{rank}.pt"), weights_only=True)
        report(f"{name}_resume_is_bit_identical",
               torch.equal(result["params"], straight["params"])
               and all(result[k] == straight[k] for k in ("steps", "rounds", "bytes")),
               f"steps {result['steps']}/{straight['steps']}, rounds {result['rounds']}/"
               f"{straight['rounds']}, max |diff| "
               f"{(result['params'] - straight['params']).abs().max().item():.1e}")
        # replicas differ at the end (two local steps after the last round): each rank's own
        gathered = [torch.zeros_like(result["params"]) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, result["params"])
        report(f"{name}_replicas_resumed_their_own_state",
               not torch.equal(gathered[0], gathered[1]), "")


# --- Hugging Face Trainer: rounds after optimizer steps 5, 9, 13; checkpoint at step 7 ----
def hf(phase, folder):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer
    from transformers import TrainingArguments

    from ddp_avg_hooks.integrations.transformers import add_local_sgd

    sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
    from hf_trainer_local_sgd import Tokens

    def trainer_with_local_sgd(out):
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)
        args = TrainingArguments(out, use_cpu=True, max_steps=14, learning_rate=3e-3,
                                 lr_scheduler_type="constant", per_device_train_batch_size=8,
                                 report_to=[], save_strategy="steps", save_steps=7,
                                 logging_strategy="no", disable_tqdm=True, seed=3,
                                 ddp_find_unused_parameters=False)
        trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
        return trainer, add_local_sgd(trainer, dah.hooks.fp16_compress_hook, period=4,
                                      warmup_steps=4, average_at_end=False)

    saved = os.path.join(folder, "hf_straight", "checkpoint-7")
    if phase == "resume":
        # the Trainer's files of step 7 with the averaging state of step 14 (the straight
        # run's): refused on every rank, nothing trained
        foreign = os.path.join(folder, "hf_foreign", "checkpoint-7")
        trainer, _ = trainer_with_local_sgd(os.path.join(folder, "hf_foreign_out"))
        if dist.get_rank() == 0:  # the Trainer's arguments made the process group
            shutil.copytree(saved, foreign)
            for r in range(dist.get_world_size()):
                name = f"ddp_avg_hooks_rank{r}.pt"
                shutil.copy(os.path.join(folder, "hf_straight", "checkpoint-14", name),
                            os.path.join(foreign, name))
        dist.barrier()
        try:
            trainer.train(resume_from_checkpoint=foreign)
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        report("hf_foreign_state_refused_on_every_rank",
               "rank 0:" in refused and "holds another model" in refused
               and trainer.state.global_step == 7, refused[:300])
    # the resumed run reads the checkpoint from another output_dir, as
    # resume_from_checkpoint allows
    out = os.path.join(folder, "hf_straight" if phase == "straight" else "hf_resumed")
    trainer, local_sgd = trainer_with_local_sgd(out)
    trainer.train(resume_from_checkpoint=saved if phase == "resume" else None)
    if phase == "straight":
        report("hf_saved_each_ranks_state",
               len(glob.glob(os.path.join(saved, "ddp_avg_hooks_rank*.pt"))) == 2, "")
    _finish(phase, folder, "hf", _result(trainer.model, local_sgd.stats, trainer.state.global_step))


# --- Accelerate: rounds after optimizer steps 5, 9, 13; save_state after step 7 ----------
def accelerate(phase, folder):
    import torch.nn.functional as F
    from accelerate import Accelerator

    from ddp_avg_hooks.integrations.accelerate import LocalSGD

    sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
    from accelerate_local_sgd import batches, make_model

    accelerator = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, batches())
    def make_local_sgd():
        return LocalSGD(accelerator, model, local_sgd_steps=4, warmup_steps=4,
                        hook=dah.hooks.fp16_compress_hook, optimizer=opt)
    local_sgd = make_local_sgd()
    ckpt = os.path.join(folder, "accelerate_state")
    start = 0
    if phase == "resume":
        accelerator.load_state(ckpt)  # each rank's own model, optimizer and averaging state
        # the block in a LocalSGD of its own, as a loop making one per epoch would: the
        # state the first one loaded goes to it
        local_sgd = make_local_sgd()
        start = 7
        loader = accelerator.skip_first_batches(loader, start)
    with local_sgd:
        for step, (x, y) in enumerate(loader, start=start):
            if phase == "straight" and step == 7:
                accelerator.save_state(ckpt)
            if step == 14:
                break
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            local_sgd.step()
        result = _result(model.module, local_sgd.handle.stats, local_sgd.handle.step_count)
    _finish(phase, folder, "accelerate", result)


# --- Accelerate, a LocalSGD per epoch (accelerate's own pattern): 3 epochs of 6 steps, each
# block warming up for 2 steps, then rounds every 2; save_state after epoch 1 ------------
def accelerate_epochs(phase, folder):
    import torch.nn.functional as F
    from accelerate import Accelerator

    from ddp_avg_hooks.integrations.accelerate import LocalSGD

    sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
    from accelerate_local_sgd import make_model

    accelerator = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)

    def local_sgd():
        return LocalSGD(accelerator, model, local_sgd_steps=2, warmup_steps=2,
                        hook=dah.hooks.fp16_compress_hook, optimizer=opt)
    ckpt = os.path.join(folder, "accelerate_epochs_state")
    first = 0
    if phase == "resume":
        local_sgd()  # made before load_state, as the accelerator's own objects
        # a copy without rank 1's file: refused on every rank before anything loads
        partial = ckpt + "_partial"
        if dist.get_rank() == 0:
            shutil.copytree(ckpt, partial)
            os.remove(os.path.join(partial, "ddp_avg_hooks_rank1.pt"))
        dist.barrier()
        before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
        try:
            accelerator.load_state(partial)
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        report("accelerate_epochs_partial_state_refused_on_every_rank",
               "rank 1:" in refused and "does not exist" in refused
               and torch.equal(before, torch.nn.utils.parameters_to_vector(model.parameters())),
               refused[:200])
        accelerator.load_state(ckpt)  # each rank's own model and momentum; no schedule
        first = 2
    for epoch in range(first, 3):
        with local_sgd() as block:
            for i in range(6):
                g = torch.Generator().manual_seed(100 * epoch + i + 1000 * dist.get_rank())
                x = torch.randn(8, 16, generator=g)
                accelerator.backward(F.mse_loss(model(x), torch.sin(x[:, :4]).sum(1, keepdim=True)))
                opt.step()
                opt.zero_grad()
                block.step()
        if phase == "straight" and epoch == 1:
            accelerator.save_state(ckpt)  # between blocks: every rank's momentum differs
            report("accelerate_epochs_registered_once", len(accelerator._custom_objects) == 1,
                   f"{len(accelerator._custom_objects)} objects registered for checkpointing")
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                          for p in model.parameters()])
    rank = dist.get_rank()
    path = os.path.join(folder, f"{phase}_epochs_rank{rank}.pt")
    if phase == "straight":
        torch.save({"params": params, "momentum": momentum}, path)
    elif phase == "resume":
        straight = torch.load(os.path.join(folder, f"straight_epochs_rank{rank}.pt"),
                              weights_only=True)
        report("accelerate_epochs_resume_is_bit_identical",
               torch.equal(params, straight["params"])
               and torch.equal(momentum, straight["momentum"]),
               f"max |diff| {(params - straight['params']).abs().max().item():.1e}")


# --- Lightning: rounds after steps 3, 8, ..., 63; the epoch ends after step 32 -----------
def lightning(phase, folder):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddp_avg_hooks.integrations.lightning import AveragingCallback

    sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
    import lightning_local_sgd as ex

    callback = AveragingCallback(dah.hooks.fp16_compress_hook, period=5, warmup_steps=2,
                                 average_at_end=False)
    ckpt_dir = os.path.join(folder, "lightning")
    callbacks = [callback]
    if phase == "straight":  # the end of epoch 1 (step 32, between two rounds)
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1,
                                         save_on_train_epoch_end=True))
    path = glob.glob(os.path.join(ckpt_dir, "*step=32*.ckpt"))[0] if phase == "resume" else None
    trainer, model = ex.fit(callbacks, max_steps=-1, max_epochs=2,
                            enable_checkpointing=phase == "straight", ckpt_path=path)
    _finish(phase, folder, "lightning", _result(model, callback.stats, trainer.global_step))


if __name__ == "__main__":
    framework, phase, folder = sys.argv[1:4]
    {"hf": hf, "accelerate": accelerate, "accelerate_epochs": accelerate_epochs,
     "lightning": lightning}[framework](phase, folder)
    exit_cleanly()
