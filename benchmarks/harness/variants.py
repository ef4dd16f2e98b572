"""The ``--hook`` choices of ``train.py``: one :class:`VariantSpec` per variant.

:data:`VARIANTS` maps each name to its record; ``train.build_variant`` and
``train.check_available``, ``timed_loop.schedule`` and ``peers.missing`` read the records'
fields, never the names.

>>> VARIANTS["int8_streaming_half_period"].fragments, VARIANTS["diloco_streaming"].overlap
(True, False)
>>> names_of(TIMED)[:2]
['allreduce_timed', 'fp16_timed']
"""
from __future__ import annotations

import dataclasses
import shlex

# families: what builds the variant
NONE = "none"                      # no communication at all
TORCH_DDP = "torch_ddp"            # DDP with one of PyTorch's gradient comm hooks
TORCH_LOCALSGD = "torch_localsgd"  # PyTorch's post_localSGD_hook + PeriodicModelAverager
PEER = "peer"                      # another library's local SGD (peers.py)
OURS = "ours"                      # ddp_avg_hooks.register_averaging_hook
HIERARCHICAL = "hierarchical"      # ours twice: rounds inside each node, and across all
TIMED = "timed"                    # ours on schedules.EverySeconds, in timed_loop.py's loop
FAMILIES = (NONE, TORCH_DDP, TORCH_LOCALSGD, PEER, OURS, HIERARCHICAL, TIMED)


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """What one ``--hook`` choice runs.

    - ``hook``: for ``TORCH_DDP``, the comm hook as ``module.attribute`` under
      ``torch.distributed.algorithms.ddp_comm_hooks``; for our families, the attribute of
      ``ddp_avg_hooks.hooks``;
    - ``inner_hook``: the ``ddp_avg_hooks.hooks`` averaging hook that ``hook`` (an outer
      optimizer) wraps;
    - ``state``: the hook's state, built from the flags: ``"powersgd"`` (the family's
      PowerSGD state, rank ``powersgd_rank`` or ``--powersgd-rank``), ``"outer"`` (DiLoCo's
      outer Nesterov SGD, ``--outer-lr`` / ``--outer-momentum``), ``None``: no state;
    - ``overlap``: rounds overlapped with training (``--mixing`` applies);
    - ``overlap_steps``: with ``overlap``, each round applied this many steps after its
      launch, whenever it completes (the registration's ``overlap_steps``; the flag
      ``--overlap-steps`` sets it for every overlapped variant);
    - ``fragments``: ``--fragments`` fragments take turns;
    - ``fragment_layout``: with ``fragments``, how the parameters are dealt into them
      (the registration's ``fragment_layout``);
    - ``optimizer_state``: the registration's ``optimizer_state`` (``"average"``: each
      round also averages the optimizer's moments exactly, over the fp32 wire);
    - ``keep_reducer``: DDP's gradient reducer keeps running after the warm-up
      (``handle.reducer_switch.release()``), copying gradients into its buckets and back
      at every backward;
    - ``period_divisor``: rounds every ``max(1, --period // period_divisor)`` steps;
    - ``weighting``: ``TIMED``: the ``EverySeconds`` weighting (``"steps"``, ``"equal"``);
    - ``library``, ``needs``: ``PEER``: ``"torchft"`` or ``"accelerate"``, and the modules
      it imports;
    - ``coded_at_launch``: the quantized hooks code the change on the training thread at
      the launch and issue their collective there (``train.coded_at_launch``), as they do
      for parameters other than float32/float64: the same round as the background-coded
      one, bit for bit, for an A/B of where the work runs;
    - ``fsdp``: the model is FSDP2-sharded per transformer block: ``"native"`` over a 2-D
      (replicate, shard) mesh, native HSDP (gradients all-reduced across replica groups at
      every step); ``"shards"`` over a 1-D shard mesh per replica group (``--fsdp-shards``
      ranks, default torchrun's ``LOCAL_WORLD_SIZE``), the replica groups averaged by
      ``hook`` over the replicate group, or not at all (family ``NONE``).
    """

    name: str
    family: str
    hook: str | None = None
    inner_hook: str | None = None
    state: str | None = None
    powersgd_rank: int | None = None
    overlap: bool = False
    overlap_steps: int | None = None
    fragments: bool = False
    fragment_layout: str = "contiguous"
    optimizer_state: str = "keep"
    keep_reducer: bool = False
    period_divisor: int = 1
    weighting: str | None = None
    library: str | None = None
    needs: tuple[str, ...] = ()
    fsdp: str | None = None
    coded_at_launch: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: unknown family {self.family!r}")
        if self.fsdp not in (None, "native", "shards"):
            raise ValueError(f"{self.name}: fsdp must be None, 'native' or 'shards'")

    @property
    def ours(self) -> bool:
        """Registered with ``ddp_avg_hooks.register_averaging_hook``."""
        return self.family in (OURS, HIERARCHICAL, TIMED)


_TORCHFT = ("torchft", "torchft.local_sgd")

_SPECS = (
    VariantSpec("none", NONE),
    VariantSpec("ddp", TORCH_DDP, hook="default_hooks.allreduce_hook"),
    VariantSpec("ddp_fp16", TORCH_DDP, hook="default_hooks.fp16_compress_hook"),
    VariantSpec("ddp_bf16", TORCH_DDP, hook="default_hooks.bf16_compress_hook"),
    VariantSpec("ddp_powersgd", TORCH_DDP, hook="powerSGD_hook.powerSGD_hook", state="powersgd"),
    VariantSpec("torch_localsgd", TORCH_LOCALSGD),
    VariantSpec("accelerate_localsgd", PEER, library="accelerate",
                needs=("accelerate", "accelerate.local_sgd")),
    VariantSpec("torchft_diloco", PEER, library="torchft", needs=_TORCHFT),
    VariantSpec("torchft_streaming_diloco", PEER, library="torchft", needs=_TORCHFT,
                fragments=True),
    VariantSpec("allreduce", OURS, hook="allreduce_hook"),
    VariantSpec("fp16", OURS, hook="fp16_compress_hook"),
    VariantSpec("bf16", OURS, hook="bf16_compress_hook"),
    VariantSpec("powersgd", OURS, hook="powersgd_hook", state="powersgd"),
    # rank 32: keeps ~98% of an 8-step AdamW delta's energy (study_powersgd.py) vs ~86% at 4
    VariantSpec("powersgd_r32", OURS, hook="powersgd_hook", state="powersgd", powersgd_rank=32),
    VariantSpec("allreduce_overlap", OURS, hook="allreduce_hook", overlap=True),
    VariantSpec("fp16_overlap", OURS, hook="fp16_compress_hook", overlap=True),
    # blockwise 8- and 4-bit deltas with error feedback
    VariantSpec("int8", OURS, hook="int8_compress_hook"),
    VariantSpec("int4", OURS, hook="int4_compress_hook"),
    VariantSpec("int4_overlap", OURS, hook="int4_compress_hook", overlap=True),
    # Streaming DiLoCo's schedule without the outer optimizer, overlapped with training
    VariantSpec("fp16_streaming", OURS, hook="fp16_compress_hook", overlap=True,
                fragments=True),
    VariantSpec("int8_streaming", OURS, hook="int8_compress_hook", overlap=True,
                fragments=True),
    VariantSpec("int4_streaming", OURS, hook="int4_compress_hook", overlap=True,
                fragments=True),
    # the same two with every fragment taking layers from all over the model
    VariantSpec("int8_streaming_interleaved", OURS, hook="int8_compress_hook", overlap=True,
                fragments=True, fragment_layout="interleaved"),
    VariantSpec("int4_streaming_interleaved", OURS, hook="int4_compress_hook", overlap=True,
                fragments=True, fragment_layout="interleaved"),
    # the latter with every round applied at the step after its launch, whenever it completes
    VariantSpec("int4_streaming_interleaved_next_step", OURS, hook="int4_compress_hook",
                overlap=True, overlap_steps=1, fragments=True, fragment_layout="interleaved"),
    # 2-bit codes: period 4 with them sends about what period 8 does with 4-bit codes
    VariantSpec("int2_streaming_interleaved", OURS, hook="int2_compress_hook", overlap=True,
                fragments=True, fragment_layout="interleaved"),
    VariantSpec("int2_streaming_interleaved_next_step", OURS, hook="int2_compress_hook",
                overlap=True, overlap_steps=1, fragments=True, fragment_layout="interleaved"),
    # the same rounds coded on the training thread at the launch, not the background one
    VariantSpec("int4_streaming_interleaved_coded_at_launch", OURS, hook="int4_compress_hook",
                overlap=True, fragments=True, fragment_layout="interleaved",
                coded_at_launch=True),
    VariantSpec("int2_streaming_interleaved_coded_at_launch", OURS, hook="int2_compress_hook",
                overlap=True, fragments=True, fragment_layout="interleaved",
                coded_at_launch=True),
    # DDP's reducer left running after the warm-up (what the hook cost before it was skipped)
    VariantSpec("int4_streaming_reducer_on", OURS, hook="int4_compress_hook", overlap=True,
                fragments=True, keep_reducer=True),
    # the same two with the optimizer's moments averaged at each round (exact, fp32)
    VariantSpec("int4_optstate", OURS, hook="int4_compress_hook", optimizer_state="average"),
    VariantSpec("int4_streaming_optstate", OURS, hook="int4_compress_hook", overlap=True,
                fragments=True, optimizer_state="average"),
    # a fragment round at every step with --fragments 4: shorter rounds of fewer bytes
    VariantSpec("int8_streaming_half_period", OURS, hook="int8_compress_hook", overlap=True,
                fragments=True, period_divisor=2),
    VariantSpec("int4_streaming_interleaved_half_period", OURS, hook="int4_compress_hook",
                overlap=True, fragments=True, fragment_layout="interleaved", period_divisor=2),
    # DiLoCo: its rounds block, as in the paper (and torchft), fragments or not
    VariantSpec("diloco", OURS, hook="outer_optimizer", inner_hook="allreduce_hook",
                state="outer"),
    VariantSpec("diloco_fp16", OURS, hook="outer_optimizer", inner_hook="fp16_compress_hook",
                state="outer"),
    VariantSpec("diloco_streaming", OURS, hook="outer_optimizer", inner_hook="allreduce_hook",
                state="outer", fragments=True),
    VariantSpec("diloco_int4", OURS, hook="outer_optimizer", inner_hook="int4_compress_hook",
                state="outer"),
    VariantSpec("diloco_int4_streaming", OURS, hook="outer_optimizer",
                inner_hook="int4_compress_hook", state="outer", fragments=True),
    VariantSpec("hierarchical", HIERARCHICAL, hook="allreduce_hook"),
    # FSDP2 replica groups: native HSDP, no sync across groups, ours, torchft's DiLoCo
    VariantSpec("hsdp_native", NONE, fsdp="native"),
    VariantSpec("fsdp_none", NONE, fsdp="shards"),
    VariantSpec("fsdp_allreduce", OURS, hook="allreduce_hook", fsdp="shards"),
    VariantSpec("fsdp_int8", OURS, hook="int8_compress_hook", fsdp="shards"),
    VariantSpec("fsdp_int8_streaming", OURS, hook="int8_compress_hook", overlap=True,
                fragments=True, fsdp="shards"),
    VariantSpec("fsdp_diloco", OURS, hook="outer_optimizer", inner_hook="allreduce_hook",
                state="outer", fsdp="shards"),
    VariantSpec("torchft_fsdp_diloco", PEER, library="torchft", needs=_TORCHFT, fsdp="shards"),
    VariantSpec("allreduce_timed", TIMED, hook="allreduce_hook", weighting="steps"),
    VariantSpec("fp16_timed", TIMED, hook="fp16_compress_hook", weighting="steps"),
    VariantSpec("allreduce_timed_equal", TIMED, hook="allreduce_hook", weighting="equal"),
    # a rank that enters a round first trains on
    VariantSpec("fp16_timed_overlap", TIMED, hook="fp16_compress_hook", weighting="steps",
                overlap=True),
    VariantSpec("fp16_timed_equal_overlap", TIMED, hook="fp16_compress_hook",
                weighting="equal", overlap=True),
)

VARIANTS: dict[str, VariantSpec] = {spec.name: spec for spec in _SPECS}


def names_of(*families: str) -> list[str]:
    """The variants of these families, in :data:`VARIANTS` order."""
    return [name for name, spec in VARIANTS.items() if spec.family in families]


def variant_flags(specs: list[str], variants: list[str]) -> dict[str, list[str]]:
    """``--variant-args VARIANT=FLAGS`` entries as ``{variant: flags}``, the flags of a
    variant named twice joined in order; a malformed entry or a variant not in
    ``variants`` raises ``ValueError`` saying which.

    >>> variant_flags(["int4_streaming=--lr 7e-4"], ["ddp", "int4_streaming"])
    {'int4_streaming': ['--lr', '7e-4']}
    """
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not flags.strip():
            raise ValueError(f"--variant-args {spec!r}: expected VARIANT=FLAGS, e.g. "
                             f"'int4_streaming=--lr 7e-4'")
        if name not in variants:
            raise ValueError(f"--variant-args {spec!r}: {name!r} is not among --variants "
                             f"({','.join(variants)})")
        out.setdefault(name, []).extend(shlex.split(flags))
    return out
