"""Run under torchrun (2 ranks) by test_integrations.py: the Trainer example, then where the
rounds fall (in optimizer steps, with gradient accumulation) and that gradients are local
between them.

Rank 0 prints one ``check <name>: ...`` line per check; any failed check raises.
"""
import os
import sys

from transformers import TrainerCallback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples", "integrations"))
from _helpers import exit_cleanly, report  # noqa: E402
import hf_trainer_local_sgd as ex  # noqa: E402

import ddp_avg_hooks as dah  # noqa: E402
from ddp_avg_hooks.integrations.transformers import add_local_sgd  # noqa: E402




class Spread(TrainerCallback):
    """The replicas' largest difference after each optimizer step (added after ours)."""

    def __init__(self, trainer):
        self.trainer, self.by_step, self.sync_flags = trainer, {}, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.by_step[state.global_step] = ex.spread(self.trainer.model)
        self.sync_flags[state.global_step] = self.trainer.model_wrapped.require_backward_grad_sync


def main():
    ex.main()
    trainer = ex.make_trainer(max_steps=13)
    rounds_at, micro = [], []
    local_sgd = add_local_sgd(trainer, dah.hooks.fp16_compress_hook, period=4, warmup_steps=4,
                              on_round=lambda h: rounds_at.append(h.step_count))
    spread = Spread(trainer)
    trainer.add_callback(spread)
    trainer.model.register_forward_hook(lambda *_: micro.append(1))
    trainer.train()
    # warm-up 4, period 4: rounds at optimizer steps 5, 9, 13 (s = 4, 8, 12), then the final one
    report("rounds_at_optimizer_steps", rounds_at == [4, 8, 12, 13] and len(micro) == 26,
           f"rounds at {rounds_at}, {len(micro)} micro-batches")
    apart = [s for s in range(1, 14) if spread.by_step[s] > 0]
    report("gradients_local_after_warmup", apart == [6, 7, 8, 10, 11, 12],
           f"replicas apart after steps {apart}")
    report("removed_at_train_end", local_sgd.handle is None and local_sgd.stats.rounds == 4, "")
    # DDP's reducer runs through the warm-up (optimizer steps 1-4), is off from the first
    # local backward on, and runs again once training ends
    flags = [spread.sync_flags[s] for s in range(1, 14)]
    report("reducer_off_after_warmup",
           flags == [True] * 4 + [False] * 9 and trainer.model_wrapped.require_backward_grad_sync,
           f"require_backward_grad_sync after each optimizer step {flags}")


if __name__ == "__main__":
    main()
    exit_cleanly()
