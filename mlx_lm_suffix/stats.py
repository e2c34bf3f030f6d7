"""Counters of drafting, reported in stats and logs."""

from __future__ import annotations

from typing import Dict


def histogram(lengths: Dict[int, int]) -> Dict[str, int]:
    """Draft-length histogram with string keys (JSON)."""
    return {str(k): v for k, v in sorted(lengths.items())}
