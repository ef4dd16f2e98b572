"""Several variants trained in the same processes, taking turns in short blocks of steps.

Run by torchrun like ``train.py`` (``bench_local_step.py`` launches it on loopback or as
two "nodes" in network namespaces). Every rank builds each ``--variants`` entry exactly as
``train.py --hook <variant>`` does, given the shared flags and then the variant's own
``--variant-args`` (its own model from ``--seed``, AdamW, learning-rate
warm-up, DDP and hook or averager, its own batch generator) and then trains them in turns:
``--blocks`` + 1 blocks of ``--block-steps`` steps each, the order of the variants rotated
by one every block, block 0 a warm-up. So a drift in the shared cores' speed, on the
scale of seconds to minutes, reaches every variant alike, which one run per variant,
minutes apart, cannot promise. Each variant computes what its own ``train.py`` run
computes, step for step: the other variants only share the process. An overlapped
round still in flight at the end of a block lands at that variant's next step, as after
one slow step; with ``overlap_steps`` it lands at the same step as in the variant's own
run. The first ``skip`` steps of each block are left out of the ratios
(``bench_local_step.py``), so the little background work such a round has left does not
weigh on the next variant's timed steps.

Each step is timed as ``train.py`` times it (``train.train_step``, the batch included);
rank 0 writes ``<out>/metrics.json``: ``config`` and, per variant, one record per step
(``block``, ``pos`` in the block, ``step_s``, ``bytes``, ``background_bytes``,
``averaged``, ``comm_s``, ``loss``, and the parts of :data:`PARTS`: forward and backward,
the training thread's CPU time in them, optimizer, averaging call, and the CPU time the
process's other threads used meanwhile).
``bytes`` counts every thread of the process, so a step's ``background_bytes`` can be the
round of the variant before it, still in flight; ``bytes - background_bytes`` is what the
step's own training thread sent.
``bench_local_step.py`` turns them into ratios within each turn.

    python -m torch.distributed.run --standalone --nproc-per-node 2 local_step.py \\
        --variants none,int4_streaming --blocks 4 --preset tiny --out /tmp/ls
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

if __package__:
    from . import records, train, uneven, variants
else:  # run as a script: this folder is sys.path[0]
    import records
    import train
    import uneven
    import variants

BLOCK_STEPS = 16
#: the parts of each step's time that ``train.train_step`` measures, kept per step
PARTS = ("fwd_bwd_s", "fwd_bwd_cpu_s", "opt_s", "avg_s", "other_cpu_s")


def refused(name: str) -> str | None:
    """Why ``name`` cannot take turns with other variants in one process (``None``: it can)."""
    spec = variants.VARIANTS.get(name)
    if spec is None:
        return f"unknown variant {name!r} (see harness/variants.py)"
    if spec.library or spec.fsdp or spec.family in (variants.TIMED, variants.HIERARCHICAL):
        return (f"{name}: peer libraries, FSDP2, hierarchical and time-based variants keep "
                "their own processes or groups; measure them with bench_train.py")
    return None


def turn_order(names: list[str], block: int) -> list[str]:
    """The variants' order in ``block``: ``names`` rotated by one per block.

    >>> turn_order(["a", "b", "c"], 1)
    ['b', 'c', 'a']
    """
    k = block % len(names)
    return names[k:] + names[:k]


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags (``flags_of``: each variant's own ``train.py`` flags, from
    ``--variant-args``), and the rest: ``train.py``'s flags for every variant."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", required=True, help="comma-separated train.py --hook names")
    p.add_argument("--blocks", type=int, default=30, help="timed blocks of each variant")
    p.add_argument("--block-steps", type=int, default=BLOCK_STEPS,
                   help="steps of one variant before the next takes its turn")
    p.add_argument("--variant-args", action="append", default=[], metavar="VARIANT=FLAGS",
                   help="more train.py flags for one variant, after the shared ones "
                        "(repeatable; e.g. 'int2_streaming_interleaved=--period 4')")
    a, rest = p.parse_known_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    why = [w for w in map(refused, a.variants) if w]
    if why:
        p.error("; ".join(why))
    if len(set(a.variants)) != len(a.variants):
        p.error(f"--variants {','.join(a.variants)}: a variant appears twice")
    if a.blocks < 1 or a.block_steps < 1:
        p.error(f"--blocks {a.blocks} and --block-steps {a.block_steps} must be >= 1")
    try:
        a.flags_of = variants.variant_flags(a.variant_args, a.variants)
    except ValueError as exc:
        p.error(str(exc))
    return a, rest


class Turn:
    """One variant as ``train.py --hook <name>`` builds it, trained a block at a time."""

    def __init__(self, name: str, flags: list[str], meter: train.CommMeter, rank: int,
                 train_data: torch.Tensor) -> None:
        self.name = name
        self.args = args = train.parse_args([*flags, "--hook", name])
        torch.manual_seed(args.seed)  # train.py's order: the seed, then the model
        model = train.CharTransformer(args.d_model, args.n_layers, args.n_heads, args.context)
        self.opt, self.sched = train.optimizer_and_schedule(model, args)
        self.variant = train.build_variant(name, model, self.opt, meter, args)
        self.gen = train.batch_generator(args, rank)
        self.slow = uneven.Slowdown(args, rank)  # no flags: nothing
        self.meter, self.data = meter, train_data
        self.records: list[dict] = []

    def block(self, index: int, steps: int) -> None:
        """``steps`` timed steps; a round still in flight lands in the next block."""
        a = self.args
        for pos in range(steps):
            t0 = time.perf_counter()
            b0, g0 = self.meter.counts()
            batch = train.get_batch(self.data, a.batch_size, a.context, self.gen)
            loss, grad_wait, averaged, avg_s, parts = train.train_step(
                self.variant, self.opt, self.sched, self.meter, self.slow, batch, t0)
            dt = time.perf_counter() - t0
            b1, g1 = self.meter.counts()
            self.records.append(dict(
                block=index, pos=pos, step_s=round(dt, 6), bytes=b1 - b0,
                background_bytes=g1 - g0,
                averaged=averaged, loss=round(loss.item(), 5),
                comm_s=round(grad_wait + avg_s + self.variant.take_comm_s(), 6),
                **{k: parts[k] for k in PARTS}))

    def finish(self) -> None:
        """Wait for the rounds still in flight (before the process group goes)."""
        for h in (self.variant.handle, self.variant.node_handle):
            if h is not None:
                h.synchronize()


def main(argv=None) -> None:
    a, rest = parse_args(argv)
    first = train.parse_args([*rest, "--hook", a.variants[0]])  # the flags all variants share
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=first.timeout))
    rank = dist.get_rank()
    meter = train.CommMeter()
    try:
        train_data, _ = train.split(train.load_corpus(first.corpus_bytes), first.val_frac)
        turns = [Turn(v, [*rest, *a.flags_of.get(v, [])], meter, rank, train_data)
                 for v in a.variants]
        if any(variants.VARIANTS[v].ours for v in a.variants):
            from ddp_avg_hooks import ops
            ops.backend()  # load (or build) the extension before the first block
        meter.install()
        t_start = time.perf_counter()
        for block in range(a.blocks + 1):
            for name in turn_order(a.variants, block):
                dist.barrier()  # every turn starts together on all ranks
                turns[a.variants.index(name)].block(block, a.block_steps)
        elapsed = time.perf_counter() - t_start
        for t in turns:
            t.finish()
        if rank == 0 and first.out:
            config = dict(vars(first), hook=None, variants=a.variants,
                          variant_flags=a.flags_of, blocks=a.blocks, block_steps=a.block_steps,
                          world_size=dist.get_world_size(),
                          torch=torch.__version__, elapsed_s=round(elapsed, 3))
            records.write_metrics(first.out, dict(
                config=config, turns={t.name: t.records for t in turns}))
        dist.barrier()
    finally:
        meter.uninstall()
        gc.collect()  # DDP and the handles freed while the interpreter is whole
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except train.HookUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
