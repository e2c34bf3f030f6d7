"""Cost-aware draft lengths: the verification cost curve (:mod:`.cost`), the
trust in the trees' estimates (:mod:`.calibration`) and the length rules
(:mod:`.rules`)."""

from .calibration import LONG_MATCH, Calibration, given_first
from .cost import VerifyCost
from .rules import (
    BATCH_MARGIN,
    best_batch_lengths,
    best_length,
)

__all__ = [
    "BATCH_MARGIN",
    "LONG_MATCH",
    "Calibration",
    "VerifyCost",
    "best_batch_lengths",
    "best_length",
    "given_first",
]
