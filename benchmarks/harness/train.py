"""Train a small character-level transformer LM with DDP or local SGD: a torchrun program.

The corpus is the Python standard library's own source (``sysconfig`` stdlib path, the
top-level ``*.py`` files in sorted order: offline, the same on every machine with the same
Python). The last ``--val-frac`` of the text is held out for validation. Tokens are bytes
(vocabulary 256).

Run::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/harness/train.py --hook allreduce --period 8 --steps 200 --out runs/a

and unchanged on many nodes (``torchrun --nnodes N --rdzv-backend c10d ...``).

``--hook`` picks a variant, one record each in :data:`variants.VARIANTS` (``variants.py``
next to this file), listed here in its order:

- ``none``: no communication at all, every rank trains alone (the physical limit);
- ``ddp``, ``ddp_fp16``, ``ddp_bf16``, ``ddp_powersgd``: DDP with PyTorch's gradient comm
  hooks (allreduce every step);
- ``torch_localsgd``: PyTorch's ``post_localSGD_hook`` + ``PeriodicModelAverager``;
- ``accelerate_localsgd``: Accelerate's ``accelerate.local_sgd.LocalSGD`` (every
  ``--period`` steps); ``torchft_diloco``, ``torchft_streaming_diloco``: torchft's
  ``local_sgd.DiLoCo`` under its fault-tolerant ``Manager``, whole model or
  ``--fragments`` fragments, with the ``diloco`` variant's outer optimizer (see
  ``peers.py`` next to this file; unavailable without the package);
- ``allreduce``, ``fp16``, ``bf16``, ``powersgd``, ``powersgd_r32`` (rank 32): ours,
  ``ddp_avg_hooks.register_averaging_hook`` with that hook plus
  ``grad_hooks.local_sgd_grad_hook`` (gradients stay local after ``--warmup``);
- ``allreduce_overlap``, ``fp16_overlap``: the same with ``overlap=True`` (a round's
  bytes travel while training goes on; ``--mixing`` applies);
- ``int8``, ``int4``: blockwise 8- and 4-bit deltas with error feedback;
  ``int4_overlap``: ``int4`` with ``overlap=True``;
- ``fp16_streaming``, ``int8_streaming``, ``int4_streaming``: ``--fragments`` fragments
  taking turns, overlapped with training (Streaming DiLoCo's schedule without the outer
  optimizer); ``int8_streaming_half_period``: the same at half of ``--period``;
  ``int8_streaming_interleaved``, ``int4_streaming_interleaved``: with
  ``fragment_layout="interleaved"`` (every fragment takes layers from all over the model);
  ``int4_streaming_interleaved_half_period``: the latter at half of ``--period``;
  ``int4_streaming_interleaved_next_step``: with each round applied at the step after
  its launch, whenever it completes (``overlap_steps=1``);
  ``int2_streaming_interleaved``, ``int2_streaming_interleaved_next_step``: the same two
  with 2-bit codes (``int2_compress_hook``; run them at half the 4-bit ones' ``--period``
  for about their bytes); ``int4_streaming_interleaved_coded_at_launch``,
  ``int2_streaming_interleaved_coded_at_launch``: the rounds of ``int4_streaming_interleaved``
  and ``int2_streaming_interleaved``, bit for bit, coded on the training thread at the
  launch instead of the background thread (:func:`coded_at_launch`);
- ``int4_streaming_reducer_on``: ``int4_streaming`` with DDP's gradient reducer left
  running after the warm-up (``handle.reducer_switch.release()``);
- ``int4_optstate``, ``int4_streaming_optstate``: ``int4`` and ``int4_streaming`` with
  ``optimizer_state="average"`` (AdamW's moments averaged exactly at each round);
- ``diloco``, ``diloco_fp16``: ``hooks.outer_optimizer(allreduce_hook)`` (resp.
  ``fp16_compress_hook``), an outer Nesterov SGD over the averaged change (DiLoCo's
  defaults, ``--outer-lr`` / ``--outer-momentum``; use a longer ``--period``, e.g. 32, and
  a smaller inner ``--lr``: the outer momentum multiplies each round's step by up to
  ``outer_lr / (1 - momentum)``, 7 with the defaults); ``diloco_streaming``: the
  ``diloco`` variant with ``fragments=--fragments`` (Streaming DiLoCo);
  ``diloco_int4``, ``diloco_int4_streaming``: the same two over ``int4_compress_hook``.
  DiLoCo's rounds block, as in the paper (and torchft): none of these overlaps;
- ``hierarchical``: exact rounds inside each node (torchrun's ``LOCAL_WORLD_SIZE`` ranks)
  every ``--intra-period`` steps, and across all ranks every ``--period``
  (``hierarchy.node_groups``, two registrations on one model);
- the model ``fully_shard``-ed per transformer block (FSDP2; ``--fsdp-shards`` ranks per
  replica group, default torchrun's ``LOCAL_WORLD_SIZE``): ``hsdp_native``, native HSDP
  over a 2-D (replicate, shard) mesh (gradients all-reduced across the replica groups at
  every step); ``fsdp_none``, the replica groups never synchronize; ``fsdp_allreduce``,
  ``fsdp_int8``, ``fsdp_int8_streaming``, ``fsdp_diloco``: ours over the replicate group
  (``grad_hooks.register_fsdp_grad_hooks``); ``torchft_fsdp_diloco``: torchft's DiLoCo,
  one replica per group;
- ``allreduce_timed``, ``fp16_timed``, ``allreduce_timed_equal``, ``fp16_timed_overlap``,
  ``fp16_timed_equal_overlap``: rounds every ``--round-seconds`` on each rank's clock
  (``schedules.EverySeconds``, ranks weighted by their steps or equally; the last two
  overlapped), in the loop of ``timed_loop.py``: ranks take different step counts.

``--round-delay S``: each round of our hooks completes ``S`` seconds late (:func:`delayed_hook`).

Rank 0 writes ``<out>/metrics.json``: the config, one record per step (training loss,
step seconds, bytes this rank handed to collectives, seconds waiting on communication,
whether parameters were averaged), validation records, and a summary. Validation (every
``--eval-every`` steps and at the end) scores the average of the ranks' parameters (see
:class:`ConsensusEval`); its time is excluded from the training clock.
``--stop-at-loss L --min-steps N`` ends the run at the first validation at or below ``L``
once ``N`` steps are done (the benchmark's "up to twice DDP's budget").
``--time-budget S`` ends it after the first step at which the training clock reaches ``S``
seconds (``make demo``: every variant gets DDP's training time), ``--eval-every-s S``
validates each time that clock passes another multiple of ``S``. Both are decided on rank
0's clock, read at the end of the step's work, and shared with one small all-reduce after
every step, so that all ranks validate and stop at the same step. That handshake is
uncounted in bytes but inside the step's time: it weighs on every variant alike, and on
local SGD (which would not otherwise wait for its peer every step) a little more.
``summary.stopped_by`` says which limit ended the run; ``summary.eval_s`` is the time
spent validating.

Bytes are counted the same way for every variant: the size of every tensor this rank
passes to ``torch.distributed`` collectives during the step (a counting wrapper around
``dist.all_reduce`` / ``all_gather`` / ...; DDP baselines run PyTorch's allreduce hook,
functionally DDP's built-in reduction, so their gradient buckets are counted too). For our
hooks ``handle.stats.bytes_sent`` is recorded as well and must agree. With 2 ranks a ring
all-reduce puts about that many bytes on the wire per rank; with ``DAH_WIRE_IFACE`` set
(the launcher does that in network namespaces) the kernel's transmit counter of that
device is recorded too. What an overlapped round's background thread hands over counts in
the step during which it does (``background_bytes`` of the step's record says how much);
a local step (``median_local_step_s``) is one that launched no round and whose training
thread handed nothing over.

Communication wait per step: DDP overlaps all-reduce with backward, so the wait that shows
is from the last bucket's hand-off (the end of backward) to the last bucket's completion;
for parameter averaging it is the wall time of the (blocking) averaging call.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import glob
import importlib
import inspect
import os
import sys
import sysconfig
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if __package__:
    from . import records, variants
else:  # run as a script: this folder is sys.path[0]
    import records
    import variants

VARIANTS = variants.VARIANTS

# ------------------------------------------------------------------------------ data

def load_corpus(max_bytes: int | None = None) -> torch.Tensor:
    """The stdlib's top-level ``*.py`` files, sorted by name, concatenated as bytes."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no *.py files under the stdlib path {root!r}")
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            b = f.read()
        chunks.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split(data: torch.Tensor, val_frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = max(int(len(data) * val_frac), 1)
    return data[:-n_val], data[-n_val:]


def get_batch(data: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    ix = torch.randint(len(data) - context - 1, (batch,), generator=gen)
    offs = torch.arange(context + 1)
    win = data[ix[:, None] + offs]
    return win[:, :-1], win[:, 1:]


# ------------------------------------------------------------------------------ model

class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A GPT-style decoder over bytes: embeddings, pre-norm blocks, tied output head."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, context: int, vocab: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


PRESETS = {  # d_model, n_layers, n_heads, context, batch_size
    "tiny": dict(d_model=32, n_layers=1, n_heads=2, context=32, batch_size=8),
    "demo": dict(d_model=128, n_layers=2, n_heads=4, context=64, batch_size=8),
    "bench": dict(d_model=160, n_layers=3, n_heads=4, context=64, batch_size=8),  # ~1M params
    "issue": dict(d_model=256, n_layers=6, n_heads=8, context=128, batch_size=4),  # ~4.8M params
}


# -------------------------------------------------------------------- communication

class CommMeter:
    """Counts bytes handed to collectives, and times DDP gradient-hook futures.

    Collectives on a group in ``skip_groups`` are not counted: an FSDP2 model's
    all-gathers inside its replica group, which never cross the link between the groups.
    ``bytes`` counts every thread's; ``background_bytes`` the part handed over by other
    threads than the one that installed the meter (an overlapped round's background
    thread), so a step whose training thread communicated nothing is told apart from one
    during which a round in flight did.
    """

    # collective -> (position, keyword) of the tensor this rank sends, position of `group`
    _WRAPPED = {"all_reduce": (0, "tensor", 2), "broadcast": (0, "tensor", 2),
                "reduce": (0, "tensor", 3), "all_gather": (1, "tensor", 2),
                "all_gather_into_tensor": (1, "input_tensor", 2),
                "all_gather_single": (1, "input_tensor", 2),
                "reduce_scatter_tensor": (1, "input", 3), "all_to_all_single": (1, "input", 4)}

    def __init__(self) -> None:
        self.bytes = 0
        self.background_bytes = 0
        self._thread = threading.get_ident()
        self._lock = threading.Lock()
        self.calls: list[float] = []
        self.dones: list[float] = []
        self.skip_groups: list = []
        self._orig: dict[str, object] = {}

    def counts(self) -> tuple[int, int]:
        """``(bytes, background_bytes)``, read together (a background thread may be adding)."""
        with self._lock:
            return self.bytes, self.background_bytes

    def install(self) -> None:
        self._thread = threading.get_ident()
        for name, where in self._WRAPPED.items():
            orig = getattr(dist, name, None)
            if orig is None or name in self._orig:
                continue
            self._orig[name] = orig
            setattr(dist, name, self._counting(orig, *where))

    def uninstall(self) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)
        self._orig.clear()

    def _counting(self, fn, pos: int, key: str, group_pos: int):
        def wrapper(*args, **kwargs):
            t = args[pos] if len(args) > pos else kwargs.get(key)
            group = args[group_pos] if len(args) > group_pos else kwargs.get("group")
            if isinstance(t, torch.Tensor) and not (
                    group is not None and any(group is g for g in self.skip_groups)):
                n = t.numel() * t.element_size()
                with self._lock:
                    self.bytes += n
                    if threading.get_ident() != self._thread:
                        self.background_bytes += n
            return fn(*args, **kwargs)
        wrapper.__wrapped__ = fn
        return wrapper

    def timed(self, hook):
        """Wrap a DDP comm hook so that each bucket's hand-off and completion are timed."""
        @functools.wraps(hook)  # hands the buckets through: see grad_hooks.ReducerSwitch
        def timed_hook(state, bucket):
            self.calls.append(time.perf_counter())
            fut = hook(state, bucket)

            def done(f):
                self.dones.append(time.perf_counter())
                return f.value()
            return fut.then(done)
        return timed_hook

    def take_grad_wait(self) -> float:
        wait = max(0.0, max(self.dones) - max(self.calls)) if self.calls and self.dones else 0.0
        self.calls.clear()
        self.dones.clear()
        return wait



class HookUnavailable(RuntimeError):
    pass


@dataclasses.dataclass
class Variant:
    """What one ``--hook`` choice does around the optimizer step."""
    name: str
    model: nn.Module                  # what forward/backward run on
    module: nn.Module                 # the bare model (for evaluation)
    after_step: callable = lambda: False   # returns True when it averaged
    handle: object = None
    node_handle: object = None              # hierarchical: the rounds inside a node
    take_comm_s: callable = lambda: 0.0     # comm seconds spent outside after_step (torchft)


# run by main() at the end, on every rank, also on failure (a peer's manager, lighthouse)
_CLOSE: list = []


def _peers():
    """``peers.py`` next to this file (torchft and Accelerate), imported on demand."""
    if __package__:
        from . import peers
    else:  # run as a script: this folder is sys.path[0]
        import peers
    return peers


def _sibling(name: str):
    """A module next to this file (``uneven``, ``timed_loop``), imported on demand."""
    return importlib.import_module(f".{name}", __package__) if __package__ else \
        importlib.import_module(name)


def _need_dah(attr: str, name: str):
    try:
        import ddp_avg_hooks as dah
        hooks = dah.hooks
        fn = getattr(hooks, attr)
        dah.register_averaging_hook, dah.grad_hooks.local_sgd_grad_hook  # noqa: B018
    except (ImportError, AttributeError) as exc:
        raise HookUnavailable(
            f"--hook {name}: ddp_avg_hooks.hooks.{attr} is not available in this build "
            f"({type(exc).__name__}: {exc}). Pick another --hook (see --help).") from None
    return dah, fn


def _powersgd_state(dah, args, rank=None):
    cls = dah.hooks.PowerSGDState
    want = dict(process_group=None, matrix_approximation_rank=rank or args.powersgd_rank,
                min_compression_rate=2.0, seed=args.seed)
    params = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in want.items() if k in params})


def _outer_state(dah, args):
    return dah.hooks.OuterOptimizerState(None, lr=args.outer_lr, momentum=args.outer_momentum)


def _our_state(dah, spec: variants.VariantSpec, args, group=None):
    """The state ``spec.state`` names, for our hooks, averaging over ``group`` (``None``:
    the default group)."""
    if spec.state == "powersgd":
        return _powersgd_state(dah, args, rank=spec.powersgd_rank)
    if spec.state == "outer":
        return dah.hooks.OuterOptimizerState(group, lr=args.outer_lr,
                                             momentum=args.outer_momentum)
    if group is not None and "int8" in (spec.hook or "") + (spec.inner_hook or ""):
        return dah.hooks.QuantizedDeltaState(process_group=group)
    return group


def _torch_comm_hook(path: str):
    """``"module.hook"`` of ``torch.distributed.algorithms.ddp_comm_hooks``, e.g.
    ``"default_hooks.allreduce_hook"``."""
    module, attr = path.rsplit(".", 1)
    return getattr(importlib.import_module(
        f"torch.distributed.algorithms.ddp_comm_hooks.{module}"), attr)


def check_available(name: str) -> None:
    """Raise :class:`HookUnavailable` with a clear message if ``--hook name`` cannot run."""
    spec = VARIANTS.get(name)
    if spec is None:
        raise HookUnavailable(f"--hook {name}: unknown; choose one of {', '.join(VARIANTS)}")
    if spec.ours:
        _need_dah(spec.hook, name)
    if spec.family == variants.PEER:
        why = _peers().missing(name)
        if why:
            raise HookUnavailable(f"--hook {name}: {why}")


def split_available(names: str) -> tuple[list[str], list[str]]:
    """``"a,b,c"`` -> (the variants that can run, ``"name: why not"`` for the others)."""
    available, unavailable = [], []
    for name in names.split(","):
        try:
            check_available(name)
            available.append(name)
        except HookUnavailable as exc:
            unavailable.append(f"{name}: {exc}")
    return available, unavailable


def delayed_hook(hook, seconds: float):
    """``hook`` whose future completes ``seconds`` after the call (and not before its own).

    Emulates a link on which a round takes that long, without a network namespace. The
    hook's spec (``ddp_avg_hooks.hook_spec``: ``needs_anchor``, ...) is kept, since
    ``functools.wraps`` copies it.
    """
    @functools.wraps(hook)
    def delayed(state, bucket):
        inner = hook(state, bucket)
        out = torch.futures.Future()

        def complete():
            try:
                out.set_result(inner.wait())
            except Exception as exc:  # hand the hook's failure to the registry
                out.set_exception(exc)
        timer = threading.Timer(seconds, complete)
        timer.daemon = True
        timer.start()
        return out
    return delayed


def coded_at_launch(hook):
    """``hook`` handed a view of each bucket whose ``change_from_snapshot`` is ``False``:
    the quantized hooks then code the change (still from the launch snapshot, the same
    bits) on the training thread at the launch and issue their first collective there, on
    the averaging group, instead of handing both to the background thread. The hook's spec
    is kept (``functools.wraps``)."""
    @functools.wraps(hook)
    def at_launch(state, bucket):
        return hook(state, _CodedAtLaunch(bucket))
    return at_launch


class _CodedAtLaunch:
    """A bucket as :func:`coded_at_launch`'s hook sees it: itself, but for
    ``change_from_snapshot``."""

    change_from_snapshot = False

    def __init__(self, bucket) -> None:
        self._bucket = bucket

    def __getattr__(self, name):
        return getattr(self._bucket, name)


class Shards:
    """An FSDP2 model's meshes: ``shards`` ranks per replica group, consecutive ranks."""

    def __init__(self, args, native: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        self.shards = args.fsdp_shards or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if world % self.shards:
            raise ValueError(f"--fsdp-shards {self.shards} must divide the world size {world}")
        self.replicas = world // self.shards
        self.mesh = init_device_mesh("cpu", (self.replicas, self.shards),
                                     mesh_dim_names=("replicate", "shard"))
        self.native = native
        self.replicate = self.mesh["replicate"].get_group()
        self.group = self.mesh["shard"].get_group()
        self.replica = dist.get_rank() // self.shards

    def shard(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` each block and the root: over the 2-D mesh (native HSDP) or the
        replica group's 1-D shard mesh."""
        from torch.distributed.fsdp import fully_shard

        mesh = self.mesh if self.native else self.mesh["shard"]
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model


def _fsdp_variant(name: str, spec, model: nn.Module, opt, meter: CommMeter, args) -> Variant:
    """An FSDP2 variant (``model`` is already sharded as ``spec.fsdp`` says)."""
    shards = model.bench_shards
    if spec.family == variants.NONE:  # native HSDP syncs inside FSDP; fsdp_none never
        return Variant(name, model, model)
    if spec.library == "torchft":
        def count(n: int) -> None:
            meter.bytes += n
        peer = _peers().TorchftDiLoCo(model, opt, args, count_bytes=count, fragments=1,
                                      replica=shards)
        _CLOSE.append(peer.close)
        return Variant(name, model, model, peer.after_step, take_comm_s=peer.take_comm_s)
    dah, hook = _need_dah(spec.hook, name)
    if spec.inner_hook is not None:
        hook = hook(getattr(dah.hooks, spec.inner_hook))
    options = _stream_options(spec, args, opt)
    handle = dah.register_averaging_hook(
        model, hook, _our_state(dah, spec, args, group=shards.replicate), period=args.period,
        warmup_steps=args.warmup, bucket_cap_mb=args.bucket_cap_mb, overlap=spec.overlap,
        **options)
    handle.detach_optimizer()  # the loop steps the handle itself (and times it)
    dah.grad_hooks.register_fsdp_grad_hooks(model, handle)
    return Variant(name, model, model, handle.step, handle)


def _stream_options(spec, args, opt=None) -> dict:
    """The registration options a variant takes from the flags and its record:
    ``fragments`` and ``fragment_layout`` for the fragment variants, ``mixing`` and
    ``overlap_steps`` for the overlapped ones, ``optimizer_state`` (with ``opt``) where
    the record sets it."""
    options = {"fragments": args.fragments, "fragment_layout": spec.fragment_layout} \
        if spec.fragments else {}
    if spec.overlap and args.mixing is not None:
        options["mixing"] = args.mixing
    overlap_steps = args.overlap_steps if args.overlap_steps is not None else spec.overlap_steps
    if spec.overlap and overlap_steps is not None:
        options["overlap_steps"] = overlap_steps
    if spec.optimizer_state != "keep":
        options.update(optimizer_state=spec.optimizer_state, optimizer=opt)
    return options


def build_variant(name: str, model: nn.Module, opt, meter: CommMeter, args) -> Variant:
    """Wrap ``model`` (DDP, hooks, a peer library) as the record of ``--hook name`` says."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    spec = VARIANTS[name]
    if spec.fsdp:
        return _fsdp_variant(name, spec, model, opt, meter, args)
    if spec.family == variants.NONE:
        return Variant(name, model, model)
    if spec.library == "torchft":  # one replica group per rank: no DDP inside it
        def count(n: int) -> None:
            meter.bytes += n
        peer = _peers().TorchftDiLoCo(model, opt, args, count_bytes=count,
                                      fragments=args.fragments if spec.fragments else 1)
        _CLOSE.append(peer.close)
        return Variant(name, model, model, peer.after_step, take_comm_s=peer.take_comm_s)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    if spec.library == "accelerate":
        peer = _peers().AccelerateLocalSGD(ddp, args)
        _CLOSE.append(peer.close)
        return Variant(name, ddp, model, peer.after_step)
    if spec.family == variants.TORCH_DDP:
        state = None
        if spec.state == "powersgd":
            state = psgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=2, min_compression_rate=2,
                                       random_seed=args.seed)
        ddp.register_comm_hook(state, meter.timed(_torch_comm_hook(spec.hook)))
        return Variant(name, ddp, model)
    if spec.family == variants.TORCH_LOCALSGD:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        state = pls.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD,
                                      start_localSGD_iter=args.warmup,
                                      post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, meter.timed(pls.post_localSGD_hook))
        averager = PeriodicModelAverager(period=args.period, warmup_steps=args.warmup)

        def after_step() -> bool:
            before = averager.step
            averaged = averager.step >= averager.warmup_steps and \
                (averager.step - averager.warmup_steps) % averager.period == 0
            averager.average_parameters(model.parameters())
            assert averager.step == before + 1
            return averaged
        return Variant(name, ddp, model, after_step)
    dah, hook = _need_dah(spec.hook, name)
    if spec.inner_hook is not None:  # an outer optimizer over an averaging hook
        hook = hook(getattr(dah.hooks, spec.inner_hook))
    if spec.coded_at_launch:
        hook = coded_at_launch(hook)
    if args.round_delay > 0:
        hook = delayed_hook(hook, args.round_delay)
    node_handle = None
    # the node rounds register first: they run first at shared steps
    if spec.family == variants.HIERARCHICAL:
        per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        groups = dah.hierarchy.node_groups(per_node, cross=False)
        node_handle = dah.register_averaging_hook(ddp, hook, groups.intra,
                                                  period=args.intra_period,
                                                  warmup_steps=args.warmup,
                                                  bucket_cap_mb=args.bucket_cap_mb)
    if spec.family == variants.TIMED:
        period = _sibling("timed_loop").schedule(dah, spec, args)
    elif spec.period_divisor > 1:
        period = max(1, args.period // spec.period_divisor)
    else:
        period = args.period
    if args.period_after is not None:
        switch_step, period_after = args.period_after
        period = dah.schedules.PostLocalPeriod(period, switch_step, period_after)
    options = _stream_options(spec, args, opt)
    handle = dah.register_averaging_hook(ddp, hook, _our_state(dah, spec, args), period=period,
                                         warmup_steps=args.warmup,
                                         bucket_cap_mb=args.bucket_cap_mb, overlap=spec.overlap,
                                         **options)
    handle.detach_optimizer()  # the loop steps the handle itself (and times it)
    ddp.register_comm_hook(handle, meter.timed(dah.grad_hooks.local_sgd_grad_hook))
    if spec.keep_reducer:
        handle.reducer_switch.release()
    if node_handle is None:
        return Variant(name, ddp, model, handle.step, handle)

    def after_step() -> bool:
        in_node = node_handle.step()
        return handle.step() or in_node
    return Variant(name, ddp, model, after_step, handle, node_handle)


# ---------------------------------------------------------------------------- main

def _step_and_period(text: str) -> tuple[int, int]:
    step, sep, period = text.partition(":")
    if not sep or not step.isdigit() or not period.isdigit():
        raise argparse.ArgumentTypeError(f"expected STEP:PERIOD, e.g. 100:8, got {text!r}")
    return int(step), int(period)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", default="allreduce", choices=VARIANTS)
    p.add_argument("--period", type=int, default=8, help="optimizer steps between averaging rounds")
    p.add_argument("--period-after", type=_step_and_period, default=None, metavar="STEP:PERIOD",
                   help="our variants without fragments: --period until STEP, then PERIOD "
                        "(schedules.PostLocalPeriod)")
    p.add_argument("--warmup", type=int, default=0,
                   help="steps of DDP gradient averaging before local SGD starts")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed-offset", type=int, default=0,
                   help="draw the training batches as seed + K would (the model still "
                        "starts from --seed): the same method on another data order")
    p.add_argument("--out", default=None, help="folder for metrics.json (rank 0)")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    for k in ("d_model", "n_layers", "n_heads", "context", "batch_size"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help="overrides --preset")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lr-warmup", type=int, default=20, help="linear learning-rate warm-up steps")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer SGD learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="diloco: outer Nesterov momentum")
    p.add_argument("--fragments", type=int, default=4,
                   help="diloco_streaming, torchft_streaming_diloco: fragments taking turns "
                        "(each averaged once per --period)")
    p.add_argument("--intra-period", type=int, default=2,
                   help="hierarchical: steps between the exact rounds inside each node")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="hierarchical: ranks per node (default: torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--fsdp-shards", type=int, default=None,
                   help="FSDP2 variants: ranks per replica group (default: torchrun's "
                        "LOCAL_WORLD_SIZE, so that each node is one replica group)")
    p.add_argument("--eval-every", type=int, default=32,
                   help="validate the ranks' average model every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-every-s", type=float, default=None,
                   help="also validate each time the training clock passes another multiple of "
                        "this many seconds")
    p.add_argument("--stop-at-loss", type=float, default=None,
                   help="stop at the first validation at or below this loss, once past --min-steps")
    p.add_argument("--min-steps", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop after the first step at which the training clock reaches this many "
                        "seconds (--steps stays the upper limit)")
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--corpus-bytes", type=int, default=None, help="use only the first N bytes")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout, seconds")
    p.add_argument("--mixing", type=float, default=None,
                   help="*_overlap: apply a late round as mixing * params + (1 - mixing) * "
                        "averaged")
    p.add_argument("--overlap-steps", type=int, default=None,
                   help="overlapped variants: apply each round this many steps after its launch, "
                        "whenever it completes (the registration's overlap_steps)")
    p.add_argument("--round-delay", type=float, default=0.0,
                   help="our hooks: a round's result arrives this many seconds late (a slow "
                        "link emulated on loopback, for overlap's staleness)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")
    _sibling("uneven").add_args(p)
    _sibling("timed_loop").add_args(p)
    args = p.parse_args(argv)
    spec = VARIANTS[args.hook]
    if args.period_after is not None and (spec.family not in (variants.OURS, variants.HIERARCHICAL)
                                          or spec.fragments or spec.fsdp):
        p.error(f"--period-after: {args.hook} takes no changing period (it needs one of our "
                "step-based variants, without fragments or FSDP2)")
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, args) -> float:
    gen = torch.Generator().manual_seed(1234)  # the same held-out windows every time
    losses = []
    for _ in range(args.eval_batches):
        x, y = get_batch(val, args.batch_size, args.context, gen)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


class ConsensusEval:
    """Validation loss of the model the ranks would agree on if training stopped now.

    That is the average of all ranks' parameters, computed into a shadow copy (training is
    untouched; its all-reduce is neither timed nor counted). After a DDP step or an
    averaging round it equals every rank's model. ``--hook none`` validates rank 0's own
    model: ranks that never communicate have no consensus.
    """

    def __init__(self, module: nn.Module, consensus: bool) -> None:
        import copy
        self.module, self.consensus = module, consensus
        self.shadow = copy.deepcopy(module) if consensus else module

    def __call__(self, val: torch.Tensor, args, all_reduce) -> float:
        if self.consensus:
            from torch.nn.utils import parameters_to_vector, vector_to_parameters
            flat = parameters_to_vector(self.module.parameters()).detach().clone()
            all_reduce(flat)
            vector_to_parameters(flat.div_(dist.get_world_size()), self.shadow.parameters())
        return evaluate(self.shadow, val, args)


class ShardedConsensusEval:
    """:class:`ConsensusEval` of an FSDP2 model: the full parameters (gathered inside each
    replica group) averaged over the replica groups, into a plain copy of the model; rank
    0's replica group's own when ``consensus`` is off."""

    def __init__(self, module: nn.Module, shadow: nn.Module, consensus: bool) -> None:
        self.module, self.shadow, self.consensus = module, shadow, consensus

    @torch.no_grad()
    def __call__(self, val: torch.Tensor, args, all_reduce) -> float:
        from torch.nn.utils import vector_to_parameters
        flat = torch.cat([p.full_tensor().reshape(-1) for p in self.module.parameters()])
        if self.consensus:
            all_reduce(flat)
            flat.div_(dist.get_world_size())
        vector_to_parameters(flat, self.shadow.parameters())
        return evaluate(self.shadow, val, args)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    try:
        check_available(args.hook)
    except HookUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1) if hasattr(torch, "set_num_interop_threads") else None
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    meter = CommMeter()
    try:
        result = _train(args, rank, world, meter)
        dist.barrier()  # nobody tears down gloo while a peer still talks to it
        return result
    finally:
        meter.uninstall()
        while _CLOSE:  # a peer's manager and lighthouse
            try:
                _CLOSE.pop()()
            except Exception as exc:  # keep closing the rest, and the process group
                print(f"warning: closing {args.hook}: {type(exc).__name__}: {exc}", file=sys.stderr)
        # free DDP and the handle (reference cycles) while the interpreter is whole: gloo
        # work objects left to interpreter finalization can abort the process at exit
        gc.collect()
        dist.destroy_process_group()


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds: its local shards of an FSDP2 model."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes
               for p in model.parameters())


def optimizer_and_schedule(model: nn.Module, args):
    """AdamW at ``--lr`` without weight decay, and its linear warm-up over ``--lr-warmup``
    steps (then constant)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(args.lr_warmup, 1)))
    return opt, sched


def batch_generator(args, rank: int) -> torch.Generator:
    """The generator of ``rank``'s training batches: each rank its own data."""
    return torch.Generator().manual_seed((args.seed + args.data_seed_offset) * 1000 + rank)


def train_step(variant: Variant, opt, sched, meter: CommMeter, slow, batch, t0: float):
    """One step's compute and averaging call, begun at ``t0``: (loss, seconds waiting on
    gradient sync, whether it averaged, seconds of the averaging call, the step's parts).

    The parts (seconds): ``fwd_bwd_s`` (forward and backward, DDP's gradient sync
    included), ``fwd_bwd_cpu_s`` (the training thread's own CPU time in them: less than
    ``fwd_bwd_s`` by the time other threads held its core, or it waited), ``opt_s`` (the
    optimizer and LR scheduler), ``avg_s`` (the averaging call), ``round_wait_s`` (the
    part of ``avg_s`` that waited for rounds' results, ``AveragingStats.wait_seconds``;
    only for variants of ours, which have a handle), and
    ``other_cpu_s``, the CPU time the process's other threads used meanwhile (gloo's and
    the rounds' background work, on the same shared cores); and ``grad_hook_calls``, the
    buckets DDP's reducer handed to the comm hook in the backward (0 where it is off).
    """
    cpu0, own0 = time.process_time(), time.thread_time()
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(variant.model(x).flatten(0, 1), y.flatten())
    loss.backward()
    t_bwd, own_bwd = time.perf_counter(), time.thread_time()
    hook_calls = len(meter.calls)
    grad_wait = meter.take_grad_wait()
    opt.step()
    sched.step()
    t_opt = time.perf_counter()
    slow.after_compute(t_opt - t0 - grad_wait)  # uneven workers: a sleep
    handles = [h for h in (variant.handle, variant.node_handle) if h is not None]
    waited = sum(h.stats.wait_seconds for h in handles)
    ta = time.perf_counter()
    averaged = bool(variant.after_step())
    avg_s = time.perf_counter() - ta  # every step: deferred phases and late write-backs too
    other_cpu = (time.process_time() - cpu0) - (time.thread_time() - own0)
    parts = dict(fwd_bwd_s=round(t_bwd - t0, 6), fwd_bwd_cpu_s=round(own_bwd - own0, 6),
                 opt_s=round(t_opt - t_bwd, 6),
                 avg_s=round(avg_s, 6), other_cpu_s=round(max(other_cpu, 0.0), 6),
                 grad_hook_calls=hook_calls)
    if handles:
        parts["round_wait_s"] = round(sum(h.stats.wait_seconds for h in handles) - waited, 6)
    return loss, grad_wait, averaged, avg_s, parts


def _train(args, rank: int, world: int, meter: CommMeter) -> dict | None:
    torch.manual_seed(args.seed)
    train_data, val_data = split(load_corpus(args.corpus_bytes), args.val_frac)
    model = CharTransformer(args.d_model, args.n_layers, args.n_heads, args.context)
    n_params = sum(p.numel() for p in model.parameters())
    spec = VARIANTS[args.hook]
    shadow = None
    if spec.fsdp:  # sharded before the optimizer sees the parameters
        import copy
        shadow = copy.deepcopy(model)  # the plain model validation loads the full weights into
        shards = Shards(args, native=spec.fsdp == "native")
        model = shards.shard(model)
        model.bench_shards = shards
        meter.skip_groups.append(shards.group)  # FSDP's own collectives stay in the group
    opt, sched = optimizer_and_schedule(model, args)
    variant = build_variant(args.hook, model, opt, meter, args)
    ops_backend = None
    if spec.ours:  # load (or build: ~1 min) the extension now, not in round 0
        from ddp_avg_hooks import ops
        ops_backend = ops.backend()
    gen = batch_generator(args, rank)
    if spec.fsdp:
        consensus_eval = ShardedConsensusEval(model, shadow, consensus=args.hook != "fsdp_none")
    else:
        consensus_eval = ConsensusEval(model, consensus=spec.family != variants.NONE)
    raw_all_reduce = dist.all_reduce
    meter.install()
    wire_if = os.environ.get("DAH_WIRE_IFACE")

    show = rank == 0 and (args.progress == "on" or (args.progress == "auto"))
    bar = None
    if show:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, desc=args.hook, dynamic_ncols=True, file=sys.stderr,
                       mininterval=0.5)
        except ImportError:
            bar = None

    steps, evals = [], []
    train_s = 0.0
    total_bytes = 0
    # per-step decisions taken on rank 0's clock and shared, so that every rank validates
    # and stops at the same step: [stop now, validate now]
    control = args.time_budget is not None or bool(args.eval_every_s)
    next_eval_s = args.eval_every_s or 0.0
    stopped_by = "steps"

    eval_s = 0.0  # wall time spent validating (off the training clock)
    wait_for_ranks = _sibling("uneven").wait_for_ranks
    val_wait_s = 0.0  # waiting for the other ranks as a validation begins (on the clock)

    def validate(i: int) -> None:
        nonlocal eval_s, train_s, val_wait_s
        waited = records.wait_before_validation(steps, wait_for_ranks, raw_all_reduce)
        train_s += waited
        val_wait_s += waited
        te = time.perf_counter()
        evals.append(dict(step=i + 1, samples=(i + 1) * args.batch_size * world,
                          train_s=round(train_s, 4), bytes=total_bytes,
                          val_loss=round(consensus_eval(val_data, args, raw_all_reduce), 5)))
        eval_s += time.perf_counter() - te

    slow = _sibling("uneven").Slowdown(args, rank)  # --jitter-sigma, --slow-rank
    slow.ready()
    if spec.family == variants.TIMED:
        return _sibling("timed_loop").run(args, rank, world, meter, dict(
            variant=variant, opt=opt, sched=sched, train_data=train_data, val_data=val_data,
            gen=gen, consensus_eval=consensus_eval, raw_all_reduce=raw_all_reduce, slow=slow,
            get_batch=get_batch, train_step=train_step, wire_if=wire_if, n_params=n_params,
            ops_backend=ops_backend, wait_for_ranks=wait_for_ranks))
    dist.barrier()
    wire0 = records.read_wire(wire_if)
    for i in range(args.steps):
        t0 = time.perf_counter()
        b0, g0 = meter.counts()
        batch = get_batch(train_data, args.batch_size, args.context, gen)
        loss, grad_wait, averaged, avg_s, parts = train_step(variant, opt, sched, meter, slow,
                                                             batch, t0)
        flags = (0.0, 0.0)
        if control:  # inside the step's time: it is a per-step handshake the run would not have
            now = train_s + time.perf_counter() - t0
            mine = torch.tensor([
                float(rank == 0 and args.time_budget is not None and now >= args.time_budget),
                float(rank == 0 and bool(args.eval_every_s) and now >= next_eval_s)])
            raw_all_reduce(mine)  # SUM of rank 0's flags and zeros: uncounted
            flags = tuple(mine.tolist())
            while args.eval_every_s and now >= next_eval_s:
                next_eval_s += args.eval_every_s
        dt = time.perf_counter() - t0
        b1, g1 = meter.counts()
        nbytes = b1 - b0
        train_s += dt
        total_bytes += nbytes
        rec = dict(step=i, loss=round(loss.item(), 5), step_s=round(dt, 6), bytes=nbytes,
                   background_bytes=g1 - g0,
                   comm_s=round(grad_wait + avg_s + variant.take_comm_s(), 6), averaged=averaged,
                   grad_wait_s=round(grad_wait, 6), **parts)
        steps.append(rec)
        if bar is not None:
            bar.set_postfix(loss=f"{rec['loss']:.3f}", step_ms=f"{dt * 1e3:.0f}",
                            MB_sent=f"{total_bytes / 1e6:.1f}", refresh=False)
            bar.update(1)
        if flags[0] > 0:  # the budget is spent: the final validation follows the loop
            stopped_by = "time_budget"
            break
        due = flags[1] > 0 or (args.eval_every and (i + 1) % args.eval_every == 0)
        if i + 1 < args.steps and due:
            validate(i)
            if args.stop_at_loss is not None and i + 1 >= args.min_steps:
                # rank 0 decides (ranks that never communicate validate different models)
                stop = torch.tensor(
                    [float(rank == 0 and evals[-1]["val_loss"] <= args.stop_at_loss)])
                raw_all_reduce(stop)  # SUM: untimed, uncounted, like validation
                if stop.item() > 0:
                    stopped_by = "stop_at_loss"
                    break
    wire1 = records.read_wire(wire_if)
    if bar is not None:
        bar.close()
    done = len(steps)
    if not (evals and evals[-1]["step"] == done):  # unless it stopped right after one
        validate(done - 1)
    evals[-1]["final"] = True
    summary = records.summarize(
        steps, evals, rank=rank, world=world, meter=meter, slow=slow,
        handles=(variant.handle, variant.node_handle), train_s=train_s, total_bytes=total_bytes,
        val_wait_s=val_wait_s, wire=(wire0, wire1), stopped_by=stopped_by, eval_s=eval_s,
        param_bytes=local_param_bytes(model))
    if summary is None:  # not rank 0
        return None
    result = records.run_result(args, world=world, n_params=n_params, wire_if=wire_if,
                                ops_backend=ops_backend, summary=summary, steps=steps,
                                evals=evals)
    print(f"[{args.hook}] world={world} params={n_params / 1e6:.2f}M steps={done} "
          f"val_loss={summary['final_val_loss']:.4f} "
          f"median_step={summary['median_step_s'] * 1e3:.1f}ms "
          f"MB/step={summary['bytes_per_step'] / 1e6:.3f} comm_share={summary['comm_share']:.2f}",
          file=sys.stderr)
    if args.out:
        records.write_metrics(args.out, result)
    return result


if __name__ == "__main__":
    main()
