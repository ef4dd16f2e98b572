"""Built-in averaging hooks: ``hook(state, bucket) -> Future[Tensor]``."""

from .compress import HalfDeltaState, bf16_compress_hook, fp16_compress_hook
from .default import allreduce_hook
from .outer import OuterOptimizerState, outer_optimizer
from .powersgd import PowerSGDState, powersgd_hook
from .quantized import (QuantizedDeltaState, int2_compress_hook, int4_compress_hook,
                        int8_compress_hook)

__all__ = [
    "HalfDeltaState",
    "OuterOptimizerState",
    "PowerSGDState",
    "QuantizedDeltaState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "int2_compress_hook",
    "int4_compress_hook",
    "int8_compress_hook",
    "outer_optimizer",
    "powersgd_hook",
]
