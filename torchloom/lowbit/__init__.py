"""Training in Loom's 21 weight dtypes: encoders, stochastic rounding, and the engine's weight
transform (``TrainingConfig(weight_dtype=..., low_bit=LowBitConfig(...))``; docs/low-bit.md).

* ``codec``: ``encode`` / ``decode`` / ``quantize`` / ``scale_for`` / ``pack`` for every dtype, the
  exact inverses of torchloom's Loom decoder;
* ``rng``: counter-based uniform draws keyed by ``(seed, step, parameter index)``;
* ``loom_compat``: Loom v0.80's own re-encoding after an update;
* ``weights``: ``LowBitWeights``, the master weights and requantisation around each update.
"""

from .codec import LOOM_DTYPES, ROUNDINGS, decode, dtype_info, encode, pack, quantize, scale_for
from .config import MASTERS, NO_MASTER_DTYPES, SCALES, LowBitConfig
from .rng import uniform, uniform_bits
from .weights import LowBitWeights

__all__ = [
    "LOOM_DTYPES", "ROUNDINGS", "MASTERS", "SCALES", "NO_MASTER_DTYPES", "LowBitConfig", "LowBitWeights",
    "encode", "decode", "quantize", "scale_for", "pack", "dtype_info", "uniform", "uniform_bits",
]
