"""One request's sampler or logits processors failing fails that request
alone, on a ``--draft suffix`` server.

mlx-lm 0.32.2's batched server samples every row of its batch in one step
(``GenerationBatch._step``, and the suffix batch's verifications): an
exception of one row's sampler or processor leaves the step, failing every
request in flight. Here each request's sampler and processors (made by
``mlx_lm.server._make_sampler`` / ``_make_logits_processors``) are wrapped:
an exception fails the request (:class:`RowFailed` on its response queue,
answered HTTP 400 or, on a started stream, an error event), the row goes on
with the greedy token, or the logits unprocessed, until the server removes
it as it removes a row whose client went away (its handler stops reading,
stock ``handle_completion`` stops its context); the other rows' tokens are
what they would have been. A sampler compiled with MLX's random state
(mlx-lm's are) leaves its tracer in that state when it raises, and every
later draw of the process fails: the state is put back.

Modules that import mlx_lm are imported where they are used (see
:mod:`mlx_lm_suffix.patches.serving`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional

from ..internals import Attached
from .serving import RequestRefused

logger = logging.getLogger("mlx_lm_suffix.isolation")


class RowFailed(RequestRefused):
    """A request's own sampler or logits processor raised in generation
    (HTTP 400 with this message)."""


class _Failure:
    """Whether one request failed in generation, and where to say so."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.error: Optional[RowFailed] = None

    def fail(self, what: str, error: Exception) -> None:
        if self.error is not None:
            return
        self.error = RowFailed(
            f"the request's {what} parameters failed in generation: "
            f"{type(error).__name__}: {error}"
        )
        logger.warning("mlx-lm-suffix: %s; the request fails alone", self.error)
        self.queue.put(self.error)


# Each tracked request's failure, by its GenerationArguments.
_failures: Attached[_Failure] = Attached()


def track(args: Any, queue: Any) -> None:
    """The generation thread took a request whose ``GenerationArguments``
    are ``args`` and response queue ``queue``: its sampler and processors
    made from ``args`` from now on fail it alone."""
    _failures.set(args, _Failure(queue))


def guard_sampler(sampler: Callable, args: Any) -> Callable:
    """``sampler``, made for ``args``, failing its request alone where
    :func:`track` was told of it (the greedy sampler, shared by the batch
    and never failing, as it is)."""
    from mlx_lm.sample_utils import greedy_sampler

    failure = _failures.get(args)
    if failure is None or sampler is greedy_sampler:
        return sampler

    def request_sampler(logprobs):
        if failure.error is None:
            result = _call(sampler, failure, "sampling", logprobs)
            if result is not _FAILED:
                return result
        return greedy_sampler(logprobs)

    return request_sampler


def guard_processors(processors: Optional[List[Callable]], args: Any) -> Optional[List[Callable]]:
    """``processors``, made for ``args``, failing their request alone (as
    :func:`guard_sampler`)."""
    failure = _failures.get(args)
    if failure is None or not processors:
        return processors

    def guarded(processor):
        def request_processor(tokens, logits):
            if failure.error is None:
                result = _call(processor, failure, "logits processor", tokens, logits)
                if result is not _FAILED:
                    return result
            return logits

        return request_processor

    return [guarded(p) for p in processors]


_FAILED = object()


def _call(fn: Callable, failure: _Failure, what: str, *inputs: Any) -> Any:
    """``fn(*inputs)``, or :data:`_FAILED` once it raised (its request failed)."""
    import mlx.core as mx

    before = mx.random.state[0]
    try:
        return fn(*inputs)
    except Exception as e:
        if mx.random.state[0] is not before:
            _restore_random_state(before)
        failure.fail(what, e)
        return _FAILED


def _restore_random_state(key: Any) -> None:
    """Make ``key`` MLX's global random key again
    (:func:`~mlx_lm_suffix.sampling.set_key`); where it cannot, a fresh
    seed at least leaves it usable."""
    import mlx.core as mx

    from .. import sampling

    try:
        if sampling.set_key(key):
            return
    except Exception:  # the key itself was unusable
        pass
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))
