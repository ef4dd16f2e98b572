"""Local SGD in a Hugging Face ``Trainer``: ``add_local_sgd(trainer, hook, period=...)``.

    torchrun --nproc-per-node 2 examples/integrations/hf_trainer_local_sgd.py

Two CPU processes train a tiny GPT-2 (2 layers, built from a config: nothing is
downloaded) on random token sequences, accumulating 2 micro-batches per optimizer step.
Gradients are averaged for the first 4 steps; after that the parameters are averaged
exactly every 4 steps, and once more when training ends.
"""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ddp_avg_hooks as dah
from _agree import spread
from ddp_avg_hooks.integrations.transformers import add_local_sgd


class Tokens(torch.utils.data.Dataset):
    """Random sequences with a pattern to learn: each token is the previous one plus 1."""

    def __init__(self, n=256, length=16, vocab=64):
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(1))
        self.ids = (start + torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out_dir="/tmp/hf_local_sgd", max_steps=21):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(out_dir, use_cpu=True, max_steps=max_steps, learning_rate=3e-3,
                             per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, ddp_find_unused_parameters=False)
    return Trainer(model=model, args=args, train_dataset=Tokens())


def main():
    trainer = make_trainer()
    if trainer.args.world_size < 2:  # the replicas' check below needs a process group
        raise SystemExit("run with: torchrun --nproc-per-node 2 "
                         "examples/integrations/hf_trainer_local_sgd.py")
    local_sgd = add_local_sgd(trainer, dah.hooks.allreduce_hook, period=4, warmup_steps=4)
    result = trainer.train()
    gap = spread(trainer.model)
    if trainer.is_world_process_zero():
        print(f"hf trainer: {type(trainer.model_wrapped).__name__} over {trainer.args.world_size} "
              f"processes, {trainer.state.global_step} steps, {local_sgd.stats.rounds} rounds, "
              f"train loss {result.training_loss:.4f}; replicas differ by {gap:.1e}")
    assert gap == 0.0, "replicas disagree after averaging"
    if trainer.is_world_process_zero():
        print("hf trainer: replicas agree")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
