"""``LowBitConfig``: how ``TrainingConfig(weight_dtype=...)`` trains weights stored in a Loom dtype."""

from __future__ import annotations

from dataclasses import dataclass

from .._settings import settings

from .codec import ROUNDINGS

__all__ = ["LowBitConfig", "MASTERS", "SCALES", "NO_MASTER_DTYPES"]

MASTERS = ("fp32", "none")
SCALES = ("per_tensor", "per_row", "fixed")
# dtypes fine enough to hold the weights alone (master="none"): an update of a few percent of a
# weight still moves it by whole steps on average (8 bits of precision or more)
NO_MASTER_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                    "uint64", "uint32", "uint16", "uint8")


@settings()
@dataclass
class LowBitConfig:
    """Settings of low-bit training (``TrainingConfig(weight_dtype=..., low_bit=LowBitConfig(...))``).

    The fields, each checked in ``__post_init__`` (``ValueError`` naming the field and the value):
    """

    master: str = "fp32"
    """One of: "fp32": float32 master weights take the updates, the dtype's values run forward and backward; "none": the weights are the dtype's values alone."""
    rounding: str | None = None
    """One of: "stochastic" (unbiased: E[q] = w), "nearest" (ties to even), None = stochastic without a master, nearest with one."""
    scale: str = "per_tensor"
    """One of: "per_tensor" (one per Loom layer, what a Loom file holds, recomputed every step), "per_row" (one per output row), "fixed" (set once from the initial weights)."""
    loom_compat: bool = False
    """True: Loom v0.80's own update (scale set once by Loom's rule, truncation, int8 wrap, round half away); master, rounding and scale must keep their defaults."""
    seed: int | None = None
    """The stochastic-rounding key; None = TrainingConfig.seed, or 0."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def effective_rounding(self) -> str:
        """``rounding``, with ``None`` resolved: ``"stochastic"`` without a master (it is what keeps
        an update smaller than a grid step alive, in expectation), ``"nearest"`` with one (the master
        keeps every update; rounding noise in the forward only costs accuracy: on digits, ternary
        95.0 % nearest vs 91.9 % stochastic, fp4 97.2 % vs 93.7 %)."""
        if self.rounding is not None:
            return self.rounding
        return "stochastic" if self.master == "none" else "nearest"

    def validate(self) -> None:
        if self.master not in MASTERS:
            raise ValueError(f"LowBitConfig: master must be one of {MASTERS}, got {self.master!r}")
        if self.rounding is not None and self.rounding not in ROUNDINGS:
            raise ValueError(f"LowBitConfig: rounding must be None (automatic) or one of {ROUNDINGS}, got {self.rounding!r}")
        if self.scale not in SCALES:
            raise ValueError(f"LowBitConfig: scale must be one of {SCALES}, got {self.scale!r}")
        if not isinstance(self.loom_compat, bool):
            raise TypeError(f"LowBitConfig: loom_compat must be a bool, got {self.loom_compat!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"LowBitConfig: seed must be an int or None, got {self.seed!r}")
        if self.loom_compat and (self.master, self.rounding, self.scale) != ("fp32", None, "per_tensor"):
            raise ValueError(
                "LowBitConfig: loom_compat=True is Loom's own update (float32 Master, its truncating and "
                "round-half-away encoders, the scale set once); leave master, rounding and scale at their "
                f"defaults, got master={self.master!r}, rounding={self.rounding!r}, scale={self.scale!r}"
            )
