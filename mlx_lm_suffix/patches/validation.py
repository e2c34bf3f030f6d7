"""Checks of a request's sampling and penalty values on a ``--draft suffix``
server, before the request joins a batch: a value that mlx-lm's sampler or
logits processors would raise on in generation gets HTTP 400 naming the
field (stock's generation thread dies on them, failing every request in
flight and after).

Only what fails is refused: where stock ignores a value (``top_k`` of a
greedy request, a context size whose penalty is 0) it serves it, and so
does a suffix server. What these checks miss fails its own request alone
(:mod:`mlx_lm_suffix.patches.isolation`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

#: The fields :func:`check_generation_fields` reads: mlx-lm 0.32.2's
#: ``SamplingArguments`` and ``LogitsProcessorArguments``, also set by
#: ``APIHandler.do_POST`` under these names.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "xtc_probability", "xtc_threshold")
PENALTIES = {
    "repetition_penalty": "repetition_context_size",
    "presence_penalty": "presence_context_size",
    "frequency_penalty": "frequency_context_size",
}
LOGITS_FIELDS = ("logit_bias", *(f for pair in PENALTIES.items() for f in pair))

#: MLX turns a Python int into a 64-bit integer: a larger one as
#: temperature or penalty raises (``std::bad_cast``).
INT64 = 2**63
#: A penalty slices the tokens seen by ``-context_size``, and MLX's slice
#: indices are 32-bit: from -2**31.
MAX_CONTEXT_SIZE = 2**31


def check_generation_fields(fields: Mapping[str, Any], vocabulary: Optional[int]) -> None:
    """Raise ``ValueError`` naming the field for a value of ``fields``
    (:data:`SAMPLING_FIELDS` and :data:`LOGITS_FIELDS`, already of the types
    stock's validation asks for) that mlx-lm 0.32.2's ``make_sampler`` or
    ``make_logits_processors`` functions raise on when they run.
    ``vocabulary``: the length of the model's logits (None: not known yet;
    ``top_k`` is then left to a later call)."""
    for name in ("temperature", *PENALTIES):
        value = fields[name]
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise ValueError(f"{name} must be a number from {-INT64} to {INT64 - 1}, got {value}")
    # make_sampler: a temperature of 0 samples greedily, ignoring the rest.
    if fields["temperature"] != 0:
        top_k, min_p = fields["top_k"], fields["min_p"]
        if vocabulary is not None and top_k > 0 and top_k >= vocabulary:
            raise ValueError(
                f"top_k must be less than the model's vocabulary ({vocabulary}), got {top_k}"
            )
        if isinstance(min_p, float) and math.isnan(min_p):
            raise ValueError("min_p must be a number from 0 to 1, got nan")
        threshold = fields["xtc_threshold"]
        if fields["xtc_probability"] > 0 and not 0 <= threshold <= 0.5:
            raise ValueError(
                f"xtc_threshold must be from 0 to 0.5 where xtc_probability is above 0, "
                f"got {threshold}"
            )
    for penalty, size in PENALTIES.items():
        if fields[penalty] != 0 and fields[size] > MAX_CONTEXT_SIZE:
            raise ValueError(
                f"{size} must be at most {MAX_CONTEXT_SIZE} (where {penalty} is not 0), "
                f"got {fields[size]}"
            )


def check_logit_bias_values(bias: Any) -> None:
    """Raise ``ValueError`` with stock's message for a ``logit_bias`` whose
    keys or values stock's validation converts with another exception than
    ``ValueError`` (a value ``null``, a list, an int too large for a
    float), which stock lets close the connection unanswered."""
    if not isinstance(bias, dict):
        return
    for key, value in bias.items():
        try:
            int(key)
            float(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError("logit_bias must be a dict of int to float") from None


def fields_of_handler(handler: Any) -> dict:
    """:func:`check_generation_fields`' fields as ``APIHandler.do_POST`` set
    them on the handler."""
    return {name: getattr(handler, name) for name in (*SAMPLING_FIELDS, *LOGITS_FIELDS)}


def fields_of_args(args: Any) -> dict:
    """The same fields of a request's ``GenerationArguments``."""
    return {**{n: getattr(args.sampling, n) for n in SAMPLING_FIELDS},
            **{n: getattr(args.logits, n) for n in LOGITS_FIELDS}}
