"""Server-side state of ``mlx_lm.server --draft suffix``.

Plain logic called from the thin wrappers of :mod:`mlx_lm_suffix.patches.server`:

- :class:`SuffixServing`, one per server (its parsed CLI namespace): a drafter
  per loaded model (kept for the server's lifetime, so switching models back
  and forth keeps each model's cache), the cache file
  (:class:`~mlx_lm_suffix.persistence.CacheFile`), the stats, and the
  server's lifetime (SIGTERM, orderly exit).
- Requests: a request's options take one way, from its handler to its row
  (see "A request's way" below); :func:`check_for_model` refuses, in the
  generation thread, what only the loaded model can tell is invalid
  (``logit_bias`` ids past its vocabulary) where the handler could not
  (:class:`RequestRefused`, answered 400).
- Failures: :func:`generate_restarting` restarts the generation loop after
  failing the requests in flight; :func:`answer_error` answers a POST whose
  handling raised.

A request's way, the one path its drafting options take (mlx-lm's server
hands a request's object to neither its batch nor its single-request loop):

1. HTTP thread, ``APIHandler.validate_model_parameters``: the body's fields
   are validated (HTTP 400 naming the field) into one
   :class:`~mlx_lm_suffix.speculation.RequestOptions`
   (:func:`request_options`), kept for the handler;
2. ``APIHandler.handle_completion(request)``: the same options go with the
   ``CompletionRequest`` it queues (:func:`hand_to_generation`), as its one
   attribute the plugin sets on a foreign object: in distributed serving,
   rank 0 shares the request with the other ranks by pickling it, and each
   rank's rows must draft alike;
3. generation thread, ``ResponseGenerator._tokenize(request)``, which runs
   right before the request joins the batch or is served alone: its
   options and prompt are *admitted* (:func:`admit`);
4. the batch's ``insert_segments`` (:func:`admitted_options`, the
   generator's ``options_source``) or the single-request
   ``stream_generate`` (:func:`single_stream_generate`) takes them, and
   the row starts with them.

The handler answers with the options' ``usage`` (:func:`add_usage`).

Modules that import mlx_lm (batch, verification, mlx_lm itself) are
imported where they are used: this module is imported while mlx-lm is
being patched, which can happen while one of them is half imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)
from urllib.parse import urlsplit

from .. import internals, ranks
from ..drafter import PRIVATE, SuffixDrafter
from ..internals import Attached
from ..metrics import METRICS_PATH, ServerMetrics
from ..persistence import CacheFile, CacheFileRefused, model_id, vocabulary_size
from ..speculation import RequestOptions
from ..stats import BatchDraftStats, RequestUsage
from . import validation
from .args import HEADER_SCOPE, SUFFIX, drafter_from_args, enabled

logger = logging.getLogger("mlx_lm_suffix.serving")

STATS_PATH = "/v1/suffix/stats"
#: Usage fields added to each response.
USAGE_DRAFTED = "draft_tokens"
USAGE_ACCEPTED = "accepted_draft_tokens"
# What the plugin keeps for mlx-lm's objects: a server's state (by its
# parsed command line), a loaded model's entry, a handler's and a request's
# options, the queues a generation loop took, whether a handler's request
# reached generation.
_states: Attached[Optional["SuffixServing"]] = Attached()
_entries: Attached["ModelEntry"] = Attached()
_handler_options: Attached[RequestOptions] = Attached()
_taken: Attached["weakref.WeakSet"] = Attached()
_generating: Attached[bool] = Attached()
# A request's record for the metrics (by its handler and by its
# CompletionRequest), and the HTTP status a handler last sent.
_records: Attached["RequestRecord"] = Attached()
_statuses: Attached[int] = Attached()
# The options a CompletionRequest carries to the generation thread, every
# rank's (see "A request's way").
_OPTIONS_ATTR = "_mlx_lm_suffix_options"


# ------------------------------------------------------------------ state
@dataclass
class ModelEntry:
    """Suffix state of one model (one ``ModelProvider.model_key``)."""

    key: Tuple[Any, ...]
    model_id: str
    name: str  # shown in the stats: a local model's folder name, or its repo id
    drafter: Optional[SuffixDrafter]  # None: the model cannot roll back
    batch_stats: BatchDraftStats
    # Whether requests wait in the server's queue (SuffixServing.requests_waiting).
    requests_waiting: Callable[[], bool]
    # The length of the model's logits vector: token ids are below it.
    output_size: int = 0
    persisted: bool = False
    # The model's batch generators alive (the server's generation thread).
    generators: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)
    # The model the server serves: the loaded one, or it paired with the
    # draft model (the drafter's draft model source).
    served: Any = None


@dataclass
class RequestRecord:
    """What a suffix server records of one request for its metrics
    (:mod:`mlx_lm_suffix.metrics`): the model that served it (set as it
    began generating), its prompt and emitted tokens, when the first and
    last token reached its handler, mlx-lm's finish reason, and its
    drafting options (their ``usage``)."""

    options: RequestOptions
    model: Optional[str] = None
    prompt_tokens: int = 0
    tokens: int = 0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    finish_reason: Optional[str] = None

    @property
    def usage(self) -> RequestUsage:
        return self.options.usage


#: Called with each drafter a server gives a draft model, once it has it
#: (``drafter.draft_model``): where a tool scripts a draft model's tokens
#: (the bench sets its :data:`~mlx_lm_suffix.sources.draft_model.Guide`).
DRAFTER_HOOKS: List[Callable[[Any], None]] = []


def give_draft_model(drafter: Any, draft_model: Any) -> None:
    """``drafter`` drafts with ``draft_model`` (a :class:`~mlx_lm_suffix.
    sources.draft_model.DraftModel`); then :data:`DRAFTER_HOOKS` run."""
    drafter.draft_model = draft_model
    for hook in DRAFTER_HOOKS:
        hook(drafter)


class SuffixServing:
    """State of one ``mlx_lm.server --draft suffix``."""

    def __init__(self, cli_args: Any):
        self.cli_args = cli_args
        self.scope = getattr(cli_args, "suffix_cache_scope", "global") or "global"
        path = getattr(cli_args, "suffix_cache_file", None)
        # Distributed: rank 0 drafts for every rank (mlx_lm_suffix.ranks), so
        # only it keeps the cache file.
        self.cache_file = CacheFile(path) if path and not ranks.following() else None
        self.num_draft_tokens = cli_args.num_draft_tokens
        self._lock = threading.RLock()
        self.entries: Dict[Tuple[Any, ...], ModelEntry] = {}
        # The generation thread's request queue (ResponseGenerator.requests).
        self.requests: Any = None
        self.metrics = ServerMetrics({
            "policy": str(getattr(cli_args, "suffix_policy", "")),
            "scope": "header" if self.scope.startswith(HEADER_SCOPE) else self.scope,
            "num_draft_tokens": str(self.num_draft_tokens),
        }, self.scope == "global", self.drafter_snapshots)

    def requests_waiting(self) -> bool:
        """Whether requests wait in the server's queue, not yet taken by the
        generation thread (which inserts them into its batch between runs of
        steps)."""
        queue = self.requests
        return queue is not None and not queue.empty()

    def on_model_loaded(self, model_path: str, model: Any, tokenizer: Any, key: Any,
                        draft: Any = None) -> ModelEntry:
        """Register (or find again) the drafter of a model just loaded, with
        the draft model loaded beside it (``draft``), if any: the drafter's
        second source, paired with ``model``
        (:class:`~mlx_lm_suffix.sources.draft_model.Paired`, the model the
        server then serves)."""
        from mlx_lm.models.cache import make_prompt_cache

        from .. import rollback
        from ..sources.draft_model import DraftModel

        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                mid = model_id(model_path, tokenizer)
                cache = make_prompt_cache(model)
                drafter = None
                if rollback.supports(cache):
                    drafter = drafter_from_args(self.cli_args)
                    if draft is not None:
                        give_draft_model(drafter, DraftModel(draft))
                        model = drafter.draft_model.pair(model)
                        cache = make_prompt_cache(model)
                    # At load, not in a request:
                    drafter.policy.ensure_cost(model)
                    if draft is not None:
                        drafter.policy.ensure_draft_cost(draft)
                    try:
                        batch_ok = rollback.supports_batch(internals.merge_caches([cache]))
                    except Exception:
                        batch_ok = False
                    # (stock's --decode-concurrency: the most rows a batch holds)
                    most = getattr(self.cli_args, "decode_concurrency", None)
                    if batch_ok and isinstance(most, int) and most > 1:
                        drafter.policy.ensure_batches(model, most, draft)
                    if not batch_ok:
                        logger.warning(
                            "mlx-lm-suffix: the batched cache of %s cannot roll rows "
                            "back; concurrent (batched) requests are served without "
                            "drafting, single requests with it.",
                            model_path,
                        )
                else:
                    logger.warning(
                        "mlx-lm-suffix: the cache of %s (%s) cannot be rolled back; "
                        "serving it without suffix drafting.",
                        model_path,
                        rollback.describe(cache),
                    )
                entry = ModelEntry(
                    key, mid, _model_name(model_path), drafter, BatchDraftStats(), self.requests_waiting,
                    output_size=output_size(model, tokenizer),
                )
                self.entries[key] = entry
            elif draft is not None and entry.drafter is not None:
                # The same models loaded again (new modules): a new pairing.
                give_draft_model(entry.drafter, DraftModel(draft))
                model = entry.drafter.draft_model.pair(model)
            entry.served = model
            _entries.set(model, entry)
            if self.cache_file is not None:
                entry.persisted = self.cache_file.attach(
                    entry.model_id, entry.drafter, vocabulary_size(model, tokenizer)
                )
            return entry

    def output_size_for(self, key: Tuple[Any, ...]) -> Optional[int]:
        """The logits length of the model with provider key ``key``, if it
        has been loaded (an entry is never removed nor changed)."""
        with self._lock:
            entry = self.entries.get(key)
        return entry.output_size if entry is not None else None

    def save(self) -> None:
        """Save the cache file, if any, where it changed."""
        if self.cache_file is not None:
            self.cache_file.save()

    @contextlib.contextmanager
    def lifetime(self) -> Iterator[None]:
        """Around the server's ``run``: the cache file saved while it runs and
        after (:meth:`CacheFile.saving`), SIGTERM handled as Ctrl-C after a
        save, and :func:`exit_after_shutdown` armed once it returns."""
        global _shutdown_done
        saving = self.cache_file.saving() if self.cache_file else contextlib.nullcontext()
        # Distributed: rank 0 answers HTTP and drafts for every rank.
        args, operator = self.cli_args, not ranks.following()
        log = self.metrics.logging(getattr(args, "suffix_log_interval", 0) if operator else 0)
        listen = self.metrics.listening(getattr(args, "suffix_metrics_host", None),
                                        getattr(args, "suffix_metrics_port", None) if operator else None)
        with saving, _sigterm_as_ctrl_c(self.save), log, listen:
            try:
                yield
            except KeyboardInterrupt:
                pass
        _shutdown_done = True

    def abandon_batches(self) -> None:
        """Stop the drafter requests of every batch generator (after the
        generation loop failed and dropped them)."""
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            for generator in list(e.generators):
                generator.close()

    # ------------------------------------------------------------- stats
    def drafter_snapshots(self) -> List[Tuple[str, Dict[str, Any]]]:
        """``(model name, its drafter's snapshot)`` of each loaded model that drafts."""
        with self._lock:
            entries = list(self.entries.values())
        return [(e.name, e.drafter.snapshot()) for e in entries if e.drafter is not None]

    def stats_payload(self) -> Dict[str, Any]:
        """The body of ``GET /v1/suffix/stats``, for anyone who can reach the
        server: settings, the drafters' limits and the batch counters, and
        with the global cache scope the counters summed over all requests
        (drafted, accepted, tokens, cache occupancy, the calibration and
        cost curves). Where the cache is partitioned by tenant
        (``--suffix-cache-scope`` user or header:NAME) those traffic
        counters are left out (``traffic_counters: false``): they are every
        tenant's traffic. Nothing in it names a file or path (models by
        folder name or repo id, whether a cache file is set), a scope or a
        header."""
        traffic = self.scope == "global"
        keys = ("drafted", "accepted", "tokens", "steps", "requests")
        totals = dict.fromkeys(keys, 0)
        totals.update(active_requests=0, cached_requests=0, cached_tokens=0, tree_responses=0)
        batch = BatchDraftStats()
        models = []
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            m: Dict[str, Any] = {"model": e.name, "drafting": e.drafter is not None,
                                 "draft_model": e.drafter is not None
                                 and e.drafter.draft_model is not None}
            if e.drafter is not None:
                m["limits"] = e.drafter.config()
                if traffic:
                    snap = e.drafter.snapshot()
                    m.update(snap)
                    for k in totals:
                        totals[k] += snap[k]
            m["batch"] = e.batch_stats.as_dict()
            m["cache_file"] = e.persisted
            batch.merge(e.batch_stats)
            models.append(m)
        payload: Dict[str, Any] = {
            "object": "suffix.stats",
            "draft": SUFFIX,
            "num_draft_tokens": self.num_draft_tokens,
            "policy": getattr(self.cli_args, "suffix_policy", None),
            "scope": "header" if self.scope.startswith(HEADER_SCOPE) else self.scope,
            "cache_file": self.cache_file is not None,
            "traffic_counters": traffic,
        }
        if traffic:
            payload.update(
                totals,
                acceptance_rate=totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
                tokens_per_step=totals["tokens"] / totals["steps"] if totals["steps"] else 0.0,
            )
        payload.update(batch=batch.as_dict(), models=models)
        return payload


def output_size(model: Any, tokenizer: Any) -> int:
    """The length of ``model``'s logits vector: the shape of a one-token
    forward on a scratch cache, built lazily and never evaluated (no
    compute); :func:`~mlx_lm_suffix.persistence.vocabulary_size` where that
    fails. Token ids at or past it index past the logits (a ``logit_bias``
    there crashes the process); the tokenizer may know fewer ids."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    try:
        n = int(model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1])
    except Exception:
        n = 0
    return n if n > 0 else vocabulary_size(model, tokenizer)


def _model_name(model_path: str) -> str:
    path = Path(model_path).expanduser()
    return path.resolve().name if path.exists() else str(model_path)


#: Seconds a SIGTERM waits for the orderly shutdown (the generation thread
#: ends its step) before the process exits without it: a step is a
#: forward, milliseconds to a second or so on a Mac's GPU, but a prompt's
#: prefill runs all its chunks in one step (minutes for a long prompt on a
#: CPU), and supervisors kill what outlasts their grace (``docker stop``:
#: 10 s), losing the save. The cache file is saved before the wait.
SHUTDOWN_GRACE_S = 5.0


@contextlib.contextmanager
def _sigterm_as_ctrl_c(before: Callable[[], None]) -> Iterator[None]:
    """In the main thread, SIGTERM calls ``before`` and then stops the
    server as Ctrl-C does (KeyboardInterrupt), exiting the process with
    status 0 if that has not ended within :data:`SHUTDOWN_GRACE_S`; a second
    one only calls ``before``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = []

    def on_sigterm(signum, frame):
        before()
        if not interrupted:
            interrupted.append(signum)
            watchdog = threading.Timer(SHUTDOWN_GRACE_S, _exit_unfinished)
            watchdog.daemon = True
            watchdog.start()
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_state_lock = threading.Lock()
_shutdown_done = False


def _exit_unfinished() -> None:
    """The orderly shutdown outlasted its grace: exit (the cache file was
    saved when SIGTERM came; requests in flight end cut, as they would)."""
    logger.warning("mlx-lm-suffix: the generation thread did not stop within %.0f s of "
                   "SIGTERM; exiting without waiting for it", SHUTDOWN_GRACE_S)
    _exit_now()


def _exit_now() -> None:
    import sys

    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(0)


def exit_after_shutdown() -> None:
    """End the process with status 0 once a suffix server has shut down in
    order (HTTP server stopped, generation thread joined, cache saved).

    Interpreter teardown after mlx_lm.server can abort in MLX's stream
    threads ("terminate called without an active exception", SIGABRT; seen
    with the stock server on Ctrl-C too); there is nothing left to clean up.
    """
    if _shutdown_done:
        _exit_now()


def state_for(cli_args: Any) -> Optional[SuffixServing]:
    """The suffix state of the server with these CLI args (None: stock)."""
    state = _states.get(cli_args, False)
    if state is not False:
        return state
    with _state_lock:
        state = _states.get(cli_args, False)
        if state is False:
            state = SuffixServing(cli_args) if enabled(cli_args) else None
            _states.set(cli_args, state)
    return state


#: Why a distributed suffix server takes no request that stock serves one at
#: a time (mlx-lm 0.32.2 ResponseGenerator._serve_single raises
#: NotImplementedError on rank 0 alone when its client disconnects, and the
#: other ranks wait for it forever).
SINGLE_PATH_DISTRIBUTED = (
    "in distributed mode mlx_lm.server serves it one request at a time and "
    "cannot stop that request on every rank if its client disconnects"
)

#: Why a distributed suffix server refuses ``--pipeline``: the ranks of
#: mlx-lm 0.32.2's batched pipeline serving can sample different tokens
#: (stock's answers then differ from one process's; found on Qwen3.5), and
#: drafts verified against different tokens would take different forwards.
PIPELINE_DISTRIBUTED = (
    "the ranks of mlx-lm's batched pipeline serving do not always sample the "
    "same tokens, and suffix decoding needs them to; serve with tensor "
    "parallelism (without --pipeline)"
)


def prepare_run(state: SuffixServing) -> None:
    """Start-up work in the main thread: refuse what a distributed suffix
    server does not support, and check the cache file against the default
    model. Exits the process when either fails."""
    distributed = ranks.group() is not None
    if distributed and getattr(state.cli_args, "kv_bits", None) is not None:
        logger.error("mlx-lm-suffix: --kv-bits is not supported with --draft suffix: %s.", SINGLE_PATH_DISTRIBUTED)
        raise SystemExit(2)
    if distributed and getattr(state.cli_args, "pipeline", False):
        logger.error("mlx-lm-suffix: --pipeline is not supported with --draft suffix: %s.", PIPELINE_DISTRIBUTED)
        raise SystemExit(2)
    model = getattr(state.cli_args, "model", None)
    draft = getattr(state.cli_args, "draft_model", None)
    if draft is not None:
        if distributed:
            logger.error("mlx-lm-suffix: --draft-model is not supported in distributed mode "
                         "(mlx-lm loads no draft model there); --draft suffix drafts from the "
                         "suffix trees alone without it.")
            raise SystemExit(2)
        problem = draft_vocabulary_problem(model, draft) if model else None
        if problem:
            logger.error("mlx-lm-suffix: %s", problem)
            raise SystemExit(2)
    if state.cache_file is None or not model:
        return
    try:
        state.cache_file.check_at_start(model)
    except CacheFileRefused as e:
        logger.error("mlx-lm-suffix: %s", e)
        raise SystemExit(2) from None


def draft_vocabulary_problem(model: Any, draft: Any) -> Optional[str]:
    """Why the draft model ``draft`` cannot draft for ``model`` (paths or
    repo ids, or tokenizers): its tokenizer's vocabulary is not the
    target's (a draft token would mean another text); None where it is."""
    from mlx_lm.utils import load_tokenizer

    def vocabulary(x: Any) -> Dict[str, int]:
        tokenizer = load_tokenizer(x) if isinstance(x, (str, os.PathLike)) else x
        return tokenizer.get_vocab()

    a, b = vocabulary(model), vocabulary(draft)
    if a == b:
        return None
    return (f"the draft model's tokenizer is not the model's ({len(b)} tokens against "
            f"{len(a)}{', other ids' if len(a) == len(b) else ''}): --draft-model needs "
            "a model of the same tokenizer (the same family)")


# --------------------------------------------------------------- requests
def scope_key(body: Dict[str, Any], headers: Any, mode: str = "user") -> Hashable:
    """A request's cache scope for ``--suffix-cache-scope`` ``mode``.

    ``user``: a hash of the API key (``Authorization: Bearer ...``) and the
    ``user`` field, both as the client sent them. ``header:NAME``: a hash of
    header NAME's value alone (set by a trusted proxy); without it,
    :data:`~mlx_lm_suffix.drafter.PRIVATE`. Raises ``ValueError`` for a
    ``user`` that is not a string, or NAME sent more than once."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ValueError("user must be a string")
    if mode.startswith(HEADER_SCOPE):
        name = mode[len(HEADER_SCOPE) :]
        values = [v.strip() for v in (headers.get_all(name) or [])] if headers else []
        if len(values) > 1:
            raise ValueError(f"more than one {name} header")
        if not values or not values[0]:
            return PRIVATE
        h = hashlib.sha256(b"mlx-lm-suffix scope\0header\0")
        h.update(values[0].encode())
        return "header:" + h.hexdigest()[:32]
    auth = headers.get("Authorization") if headers is not None else None
    key = None
    if auth:
        parts = auth.split(None, 1)
        key = parts[1].strip() if len(parts) == 2 and parts[0].lower() == "bearer" else auth
    if not user and not key:
        return "anonymous"
    h = hashlib.sha256(b"mlx-lm-suffix scope\0")
    h.update(f"key={key or ''}\0user={user or ''}".encode())
    return "user:" + h.hexdigest()[:32]


class DraftRefused(ValueError):
    """``draft_model: "suffix"`` sent to a server started without ``--draft suffix``."""


class RequestRefused(ValueError):
    """A request that is invalid for its model (HTTP 400 with this message)."""


class Refused(BaseException):
    """A :class:`RequestRefused` of the generation thread on its way from
    ``ResponseGenerator.generate`` to ``do_POST`` (see
    :mod:`mlx_lm_suffix.patches.server`), which answers 400 with its
    message: not an ``Exception``, so that stock ``handle_completion``'s
    ``except Exception`` (HTTP 404) lets it pass."""


def check_logit_bias(bias: Any, size: Optional[int]) -> None:
    """Raise :class:`RequestRefused` for a ``logit_bias`` key that indexes
    no token of the model's logits: at or past ``size`` (their length;
    None: not known yet, nothing checked), or before ``-size``. Stock
    indexes the logits with it unchecked, which crashes the process or
    writes past them. A negative key from ``-size`` counts from the end, as
    stock's indexing takes it (``-1``: the last id), so it is served as
    stock serves it. Keys that are not ints are left to stock's validation."""
    if not isinstance(bias, dict) or size is None:
        return
    for key in bias:
        if isinstance(key, int) and not -size <= key < size:
            raise RequestRefused(f"logit_bias key {key} is not a token id of this model "
                                 f"(its token ids are 0 to {size - 1})")


def wants_logprobs(handler: Any) -> bool:
    """Whether the response carries logprobs (``logprobs``, or
    ``top_logprobs`` > 0, which stock answers with them too)."""
    top = getattr(handler, "top_logprobs", -1)
    return getattr(handler, "logprobs", False) is True or (isinstance(top, int) and top > 0)


def request_options(handler: Any) -> Optional[RequestOptions]:
    """Validate the suffix fields of a request (after stock validation):
    its :class:`~mlx_lm_suffix.speculation.RequestOptions` (None on a stock
    server), kept for the handler (see "A request's way").

    A request's ``num_draft_tokens`` is capped by the server's
    ``--num-draft-tokens`` (on every path, prompt copies included). Raises
    ``ValueError`` (the handler answers HTTP 400). Normalises the handler's
    ``requested_draft_model`` so the request batches with others.
    """
    _handler_options.pop(handler)
    state = state_for(handler.response_generator.cli_args)
    draft = handler.requested_draft_model
    if state is None:
        if draft == SUFFIX:
            raise DraftRefused("draft_model 'suffix' needs a server started with --draft suffix")
        return None
    if ranks.group() is not None and handler.seed is not None:
        raise ValueError(f"seed is not supported with --draft suffix: {SINGLE_PATH_DISTRIBUTED}")
    if handler.seed is not None and not 0 <= handler.seed < 2**64:
        # mx.random.seed takes a uint64 (stock: a TypeError in the generation
        # thread, the connection dropped).
        raise ValueError(f"seed must be an integer from 0 to {2**64 - 1}, got {handler.seed}")
    if handler.max_tokens < 1:
        # mlx-lm 0.32.0 validates max_tokens >= 0, and 0 then fails in the
        # batch (HTTP 500); 0.32.1 asks for at least 1 itself, in these words.
        raise ValueError("max_tokens must be at least 1")
    if draft is not None and not isinstance(draft, str):
        raise ValueError(f"draft_model must be a string, got {draft!r}")
    if draft not in (SUFFIX, "default_model", None):
        raise ValueError(
            f"Unknown draft_model {draft!r}: this server drafts with suffix decoding; "
            f"use 'suffix' (the default) or null to turn drafting off"
        )
    n = handler.num_draft_tokens
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"num_draft_tokens must be a non-negative integer, got {n!r}")
    if n < 0:
        raise ValueError(f"num_draft_tokens must be a non-negative integer, got {n}")
    _check_body(handler)
    # Token ids past the model's logits (and top_k): checked here where the
    # requested model has been loaded before (its size never changes), else
    # in the generation thread once it is (check_for_model).
    key = internals.model_key(handler.response_generator.model_provider,
                              handler.requested_model, handler.adapter)
    size = state.output_size_for(key) if key is not None else None
    check_logit_bias(getattr(handler, "logit_bias", None), size)
    validation.check_generation_fields(validation.fields_of_handler(handler), size)
    scope = None
    if state.scope != "global":
        scope = scope_key(handler.body, handler.headers, state.scope)
    handler.requested_draft_model = "default_model"
    # --num-draft-tokens is a hard limit: a request may lower it, not raise it.
    n = min(n, state.num_draft_tokens)
    # A verification forward's logprobs (and the K/V it leaves in the cache)
    # differ from one-token steps' in the last bits, and so does the order
    # of stock's unsorted top_logprobs: a request for them is not drafted.
    drafting = draft is not None and n > 0 and not wants_logprobs(handler)
    options = RequestOptions(num_draft_tokens=n if drafting else 0, scope=scope,
                             usage=RequestUsage(), arrived=time.perf_counter())
    _handler_options.set(handler, options)
    _records.set(handler, RequestRecord(options))
    return options


def _check_body(handler: Any) -> None:
    """Raise ``ValueError`` for body fields stock would fail on in the
    generation thread, ending it (its checks come later)."""
    if urlsplit(handler.path).path == "/v1/completions" and "prompt" in handler.body:
        prompt = handler.body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            # Stock: an empty one ends the generation thread, other types
            # fail in the tokenizer.
            raise ValueError("prompt must be a non-empty string")
    # Stock takes `body.get("stop") or []`, a string as one word, and
    # iterates anything else: an object's keys are words too. Words that
    # are not strings: a TypeError in the generation thread, which ends it.
    stop = handler.body.get("stop") or []
    if not (isinstance(stop, str) or (
            isinstance(stop, (list, dict)) and all(isinstance(w, str) for w in stop))):
        raise ValueError("stop must be a string or a list of strings")
    options = handler.body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ValueError("stream_options must be an object")


def check_for_model(provider: Any, args: Any, request: Any = None) -> None:
    """In the generation thread, with the request's model loaded
    (``provider.model``; ``args``: its ``GenerationArguments``): raise
    :class:`RequestRefused` for what the handler could not check before
    that model was loaded (``logit_bias`` ids past its logits, ``top_k``);
    the request's info learns which model serves it."""
    if state_for(provider.cli_args) is None:
        return
    entry = _entries.get(provider.model)
    size = entry.output_size if entry is not None else None
    check_logit_bias(args.logits.logit_bias, size)
    try:
        validation.check_generation_fields(validation.fields_of_args(args), size)
    except ValueError as e:
        raise RequestRefused(str(e)) from None
    record = _records.get(request)
    if record is not None and entry is not None:
        record.model = entry.name


def stream_options_with_usage(options: Any) -> Any:
    """``stream_options`` with ``include_usage`` (false where it is
    missing): mlx-lm 0.32.2 ``APIHandler.handle_completion`` reads
    ``stream_options["include_usage"]`` after the last event and, on a
    KeyError, ends the stream without ``[DONE]``."""
    if isinstance(options, dict) and "include_usage" not in options:
        return {**options, "include_usage": False}
    return options


def hand_to_generation(handler: Any, request: Any) -> bool:
    """The handler's options go with the ``CompletionRequest`` it queues;
    whether it has any (a suffix server's request)."""
    options = _handler_options.get(handler)
    if options is not None:
        setattr(request, _OPTIONS_ATTR, options)
        record = _records.get(handler)
        if record is not None:
            _records.set(request, record)
    return options is not None


def add_usage(response: Dict[str, Any], handler: Any) -> Dict[str, Any]:
    """Add the handler's request's draft counters to a response's ``usage``."""
    options = _handler_options.get(handler)
    usage = response.get("usage") if isinstance(response, dict) else None
    if options is not None and isinstance(usage, dict):
        usage[USAGE_DRAFTED] = options.usage.drafted
        usage[USAGE_ACCEPTED] = options.usage.accepted
        usage[USAGE_DRAFTED + "_by_source"] = dict(options.usage.source_drafted)
        usage[USAGE_ACCEPTED + "_by_source"] = dict(options.usage.source_accepted)
    return response


def is_stats_path(path: str) -> bool:
    return urlsplit(path).path.rstrip("/") == STATS_PATH


def is_metrics_path(path: str) -> bool:
    return urlsplit(path).path.rstrip("/") == METRICS_PATH


def timed_responses(request: Any, ctx: Any, responses: Iterator[Any]) -> Iterator[Any]:
    """The token responses of a request that began generating (``ctx``: its
    ``GenerationContext``), as its handler reads them, noted in its
    :class:`RequestRecord`: tokens, when the first and last came, the
    finish reason."""
    record = _records.get(request)
    if record is None:
        return responses
    record.prompt_tokens = len(ctx.prompt)

    def noted() -> Iterator[Any]:
        for r in responses:
            record.last_token_at = time.perf_counter()
            if record.first_token_at is None:
                record.first_token_at = record.last_token_at
            record.tokens += 1
            record.finish_reason = r.finish_reason or record.finish_reason
            yield r

    return noted()


def observe_post(handler: Any, started: float, error: Optional[BaseException]) -> None:
    """A completion POST of a suffix server ended (``started``: when its
    handler began; ``error``: what ended its answer, if anything): count it
    in the metrics."""
    outcome = None
    if isinstance(error, (BrokenPipeError, ConnectionResetError)):
        outcome = "abort"
    elif error is not None:
        outcome = "error"
    state = state_for(handler.response_generator.cli_args)
    state.metrics.observe(urlsplit(handler.path).path, _statuses.get(handler),
                          _records.get(handler), started, outcome)


def start_post(handler: Any) -> float:
    """A POST begins on a suffix server's handler (which a kept-alive
    connection reuses): forget the last request's; returns the time."""
    _records.pop(handler)
    _statuses.pop(handler)
    return time.perf_counter()


def note_status(handler: Any, code: int) -> None:
    """The handler sent HTTP status ``code`` (the last one sent counts)."""
    _statuses.set(handler, code)


# The request the server's generation thread is admitting: set when its
# prompt is tokenized, taken by the batch insert or single-request call that
# follows in the same thread.
_admitting = threading.local()


def admit(cli_args: Any, request: Any, prompt: Sequence[int]) -> None:
    """The generation thread tokenized ``request``'s ``prompt``: its options
    (with the whole prompt) are the next row's."""
    if state_for(cli_args) is None:
        return
    if len(prompt) == 0:
        # Stock inserts it into the batch, whose ValueError ends the
        # generation thread; raised here, it fails this request only.
        raise ValueError("The prompt is empty: it encodes to no tokens.")
    options = getattr(request, _OPTIONS_ATTR, None)
    prompt = list(prompt)
    _admitting.value = replace(options, prompt=prompt) if options is not None else None


def _take_admitted() -> Optional[RequestOptions]:
    options = getattr(_admitting, "value", None)
    _admitting.value = None
    return options


def admitted_options(segments: Sequence[Sequence[int]], all_tokens: Sequence[int]
                     ) -> RequestOptions:
    """The options of a sequence the server inserts into its batch: the
    admitted request's, where its prompt is that sequence's."""
    options = _take_admitted()
    full = list(all_tokens) + [t for s in segments for t in s]
    if options is None or options.prompt != full:
        # Not the request we were told about: no drafting, nothing cached.
        return RequestOptions(use_drafter=False)
    return options


def make_batch_generator(stock_cls: Callable[..., Any], model: Any, **kwargs: Any) -> Any:
    """The server's ``BatchGenerator(model, ...)``: a suffix batch generator
    for a model registered by a suffix server, else the stock one."""
    entry = _entries.get(model)
    if entry is None or entry.drafter is None:
        return stock_cls(model, **kwargs)
    from ..batch import SuffixBatchGenerator

    generator = SuffixBatchGenerator(
        model,
        entry.drafter,
        options_source=admitted_options,
        stats=entry.batch_stats,
        requests_waiting=entry.requests_waiting,
        **kwargs,
    )
    entry.generators.add(generator)
    return generator


def on_model_loaded(provider: Any, model_path: str, draft_path: Any = None) -> None:
    """``provider`` (a ``ModelProvider``) loaded the model at ``model_path``
    (and its draft model, if any). With a draft model and a drafter, the
    provider serves the pair: requests batch (stock serves a draft model's
    requests one at a time) and the draft model drafts where the trees have
    nothing worth verifying."""
    state = state_for(provider.cli_args)
    if state is None or provider.model is None:
        return
    if provider.draft_model is not None:
        problem = draft_vocabulary_problem(provider.tokenizer, draft_path)
        if problem:
            provider.reset()  # (a request for these models loads them again)
            raise ValueError(problem)
    entry = state.on_model_loaded(model_path, provider.model, provider.tokenizer,
                                  provider.model_key, provider.draft_model)
    if entry.served is not provider.model:
        from mlx_lm.models.cache import make_prompt_cache

        provider.model, provider.draft_model = entry.served, None
        provider.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(entry.served))


def single_stream_generate(
    stream_generate: Callable[..., Any],
    model: Any,
    tokenizer: Any,
    prompt: Any,
    max_tokens: int,
    draft_model: Any,
    kwargs: Dict[str, Any],
):
    """The server's single-request ``stream_generate`` call, with the suffix
    drafter of the model and the admitted request's options when it asked
    for it."""
    options = _take_admitted()
    full = options.prompt if options is not None else []
    entry = _entries.get(model)
    if (
        draft_model is not None
        or options is None
        or entry is None
        or entry.drafter is None
        or kwargs.get("input_embeddings") is not None
        or not isinstance(prompt, list)
        or len(prompt) > len(full)
        or full[len(full) - len(prompt) :] != prompt
    ):
        return stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft_model, **kwargs
        )
    kwargs = dict(kwargs)
    kwargs.pop("input_embeddings", None)
    kwargs.update(num_draft_tokens=options.num_draft_tokens, draft_options=options)
    return stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, draft_model=entry.drafter, **kwargs
    )


# -------------------------------------------------------------- failures
#: What a client is told when generation failed (the details go to the log:
#: one request's failure fails every request of its batch).
GENERATION_FAILED = "generation failed (details in the server log)"


def _in_flight(generator: Any) -> "weakref.WeakSet":
    """The response queues of the requests ``generator`` (a
    ``ResponseGenerator``) took and has not failed."""
    queues = _taken.get(generator)
    if queues is None:
        queues = weakref.WeakSet()
        _taken.set(generator, queues)
    return queues


def note_request_taken(generator: Any, item: Any) -> None:
    """The generation thread took ``(rqueue, request, args)`` off the queue."""
    if item is not None and state_for(generator.cli_args) is not None:
        _in_flight(generator).add(item[0])


def generate_restarting(generator: Any, stock_generate: Callable[[Any], None]) -> None:
    """The generation loop (``ResponseGenerator._generate``) of a suffix server.

    Stock ``_run_generate`` runs the loop once: any exception of it (e.g. in
    a batched forward) ends the thread, every later request then fails with
    "generation thread died", and the requests in flight wait for it to
    notice. Here the requests in flight get a generic error
    (:data:`GENERATION_FAILED`; the exception goes to the log), the drafter requests
    of the abandoned batch are stopped, and the loop runs again (it keeps the
    loaded model and prompt cache). A loop that fails before taking any
    request (e.g. the model does not load), or once the server is stopping,
    raises to stock ``_run_generate``, which ends the thread; so does any
    loop in distributed mode.
    """
    state = state_for(generator.cli_args)
    if state is not None:
        # mlx-lm 0.32.2: ResponseGenerator.requests, the Queue its HTTP
        # handlers put requests in (none: no signal).
        requests = getattr(generator, "requests", None)
        state.requests = requests if hasattr(requests, "empty") else None
    if state is None or ranks.group() is not None:
        # Distributed: a loop run again on one rank would not pair its
        # collectives with the other ranks'; it ends, as stock's does.
        return stock_generate(generator)
    queues = _in_flight(generator)
    while True:
        queues.clear()  # (finished requests' queues are gone or drained)
        try:
            return stock_generate(generator)
        except Exception as e:
            taken = list(queues)
            for q in taken:
                # (extra items in finished requests' queues are never read)
                q.put(RuntimeError(GENERATION_FAILED))
            state.abandon_batches()
            if internals.stopping(generator) or not taken:
                raise
            logger.exception("mlx-lm-suffix: the generation loop failed: %s", e)
            logger.warning(
                "mlx-lm-suffix: failed %d request(s) in flight; generation restarted",
                len(taken),
            )


def answer_error(handler: Any, error: BaseException) -> None:
    """Answer a POST whose handling raised (stock lets the exception close
    the connection without a response): a JSON error while nothing was
    sent, an error event on a started stream. A failure in generation is
    answered with :data:`GENERATION_FAILED` (its details go to the log); a
    failure before it (the request's own body) with its message. A client
    that went away gets nothing."""
    handler.close_connection = True
    if isinstance(error, (BrokenPipeError, ConnectionResetError)):
        logger.debug("mlx-lm-suffix: client disconnected: %s", error)
        return
    # A refusal raised in generation is the request's own (its parameters).
    generating = bool(_generating.get(handler, False)) and not isinstance(error, RequestRefused)
    logger.error("mlx-lm-suffix: request failed: %s", error, exc_info=generating)
    message = GENERATION_FAILED if generating else str(error) or type(error).__name__
    try:
        if internals.headers_unsent(handler):
            if isinstance(error, UnicodeDecodeError):
                message = f"Invalid JSON in request body: {error}"
            body = json.dumps({"error": message}).encode()
            internals.start_json_response(handler, 500 if generating else 400)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        elif getattr(handler, "stream", False):
            kind, code = ("server_error", 500) if generating else ("invalid_request_error", 400)
            event = {"error": {"message": message, "type": kind, "code": code}}
            handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        handler.wfile.flush()
    except OSError:
        pass


def mark_generating(handler: Any, generating: bool = True) -> None:
    """Whether the request being handled reached generation (an error after
    that is the server's: 500)."""
    _generating.set(handler, generating)
