"""Side-by-side benchmark of stock mlx-lm and suffix decoding.

Arms (in-process, ``mlx_lm.stream_generate``, concurrency 1):

- ``stock``: no drafting.
- ``suffix-cold``: a fresh :class:`SuffixDrafter` (empty global cache).
- ``suffix-warm``: a fresh drafter that first replays the workload (untimed).
- ``oracle``: an upper bound, :class:`OracleDrafter` drafts the exact
  reference continuation through the same verification loop;
  ``oracle@N`` does it with drafts of up to ``N`` tokens.
- ``suffix-cold-fixed``, ``suffix-warm-fixed``: the suffix arms with
  fixed-length drafting, to compare the policies in one run.

With a draft model (``draft_model_path``): ``stock-draft`` (stock's own
speculative decoding with it) and ``suffix-draft`` (a fresh drafter with it
beside the trees); in scripted mode both see the same :class:`DraftScript`
(the draft model agrees with the target on a set share of positions), and
each reports its draft model's acceptance and agreement
(:func:`model_figures`).

With ``server=True`` the workload also goes through real ``mlx_lm.server``
subprocesses on 127.0.0.1 at each requested concurrency: ``server-stock`` and
``server-stock-warm`` (a stock server, first and second pass over the
workload), ``server-suffix-cold`` and ``server-suffix-warm`` (a fresh
``--draft suffix`` server, first and second pass), and with
``server_fixed=True`` also ``server-suffix-cold-fixed`` and
``server-suffix-warm-fixed`` (the same with ``--suffix-policy fixed``), and
with a draft model ``server-stock-draft`` and ``server-suffix-draft-cold``/
``-warm`` (:data:`SERVER_DRAFT_ARMS`). Warm
passes are compared with ``server-stock-warm``, whose prompt cache is
equally warm.

Scripted-target mode (for random-weight models): the real forward runs at
full cost and :class:`ScriptedProcessor` biases the logits so the greedy
output is the workload's reference answer. For servers the processor is
installed by :func:`serve_main` from ``$MLX_LM_SUFFIX_SCRIPT`` (a JSONL of
``{"prompt_ids", "reference_ids"}``).

Each suffix arm also reports the verification cost curve its drafter
learnt (``verify_cost``: a forward over ``n`` tokens relative to a plain
step, whose seconds are ``plain_step_s``; ``None`` with fixed lengths, which
learn none), the curve it started from (``calibrated_cost``, of a plain step
of ``calibrated_step_s``), the host's wait after each read of a forward
(``idle_s_per_wait``), these for the first repetition and all of them in
``costs_per_rep`` (with ``decode_speedup_per_rep``; every arm keeps its
``decode_tokens_per_s_per_rep``), and its replays (a
rejection on a model with recurrent state restores the state and feeds the
kept tokens again): ``replays``, ``replayed_tokens`` and ``replay_share``,
the share of the arm's time those forwards took, estimated from the curve
(timing them would add a sync to every replay). Server arms report theirs
in ``server_stats`` (the suffix servers' stats endpoint after the pass: the
cold arm's after the cold pass, the warm arm's after both), the first
repetition's, and every repetition's in ``server_stats_per_rep`` (each
repetition's servers are fresh).

Ratios are medians of per-repetition ratios to ``stock`` (the same
repetition). Each arm also reports the spread of its per-request ratios
(``per_request``, :func:`request_spreads`; None for a baseline arm
itself): a request's ratio is its tokens/s (end to end, and decode) over
the baseline arm's on the same request in the same repetition, the median
over repetitions; over the requests, their median, 10th percentile, the
worst ratio and which request it was. Server arms pair requests by id with
the stock server's same pass (:func:`baseline_arm`).

Arms run interleaved, so that the machine's drift over a run weighs on all
of them alike: in process, each request goes through every arm in turn;
through servers, all servers of a repetition run at once and each wave of
``concurrency`` sessions goes to every server in turn. The order alternates
from request (wave) to request (wave).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..drafter import SuffixDrafter
from ..patches.serving import STATS_PATH
from ..sources import Draft
from ..sources.draft_model import vocabulary_problem
from .launcher import ServerProcess, distributed_command
from .workloads import read_jsonl, read_workload

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
#: Environment variable naming the script JSONL read by :func:`serve_main`.
SCRIPT_ENV = "MLX_LM_SUFFIX_SCRIPT"
#: :func:`serve_main` as a server command (see :class:`ServerProcess`).
SERVE_MAIN = (
    sys.executable,
    "-c",
    "import sys; from mlx_lm_suffix.tools.bench import serve_main; serve_main(sys.argv[1:])",
)
#: Set in a process re-executed with OpenBLAS preloaded.
BLAS_ENV = "MLX_LM_SUFFIX_BLAS"
INPROCESS_ARMS = (
    "stock",
    "stock-draft",
    "suffix-draft",
    "suffix-cold",
    "suffix-warm",
    "oracle",
    # The same with fixed-length drafting, to compare the policies in one run.
    "suffix-cold-fixed",
    "suffix-warm-fixed",
)
DEFAULT_ARMS = ("stock", "suffix-cold", "suffix-warm", "oracle")
#: Arms with a draft model (``--draft-model``): stock mlx-lm's speculative
#: decoding with it, and a fresh drafter with it beside the trees.
DRAFT_ARMS = ("stock-draft", "suffix-draft")
#: The default arms with a draft model.
DEFAULT_DRAFT_ARMS = ("stock", "stock-draft", "suffix-cold", "suffix-draft")
#: Stock's draft tokens a round (mlx-lm's ``--num-draft-tokens`` default).
STOCK_DRAFT_TOKENS = 3
#: The prompt's chunk in every in-process arm: ``mlx_lm.generate``'s
#: ``--prefill-step-size`` default, which its CLI passes with a draft model
#: too (stock's ``speculative_generate_step`` defaults to 512 in Python, and
#: on a CPU smaller chunks prefill faster: the arms would then differ in
#: their prefill's chunks, not in how they decode).
PREFILL_STEP_SIZE = 2048
#: The scripted draft model's default agreement with the target.
DRAFT_AGREEMENT = 0.75
#: ``--draft-model`` names of the local random-weight models.
LOCAL_SIZES = ("tiny", "mini", "small", "bench")
#: A drafter arm's cost figures kept for every repetition (``costs_per_rep``),
#: each repetition's drafter being fresh: what a replay needs to run as it ran.
REP_COSTS = ("calibrated_cost", "calibrated_step_s", "verify_cost", "plain_step_s",
             "idle_s_per_wait")
SERVER_ARMS = ("server-stock", "server-stock-warm", "server-suffix-cold", "server-suffix-warm")
SERVER_FIXED_ARMS = ("server-suffix-cold-fixed", "server-suffix-warm-fixed")
#: Server arms with ``--draft-model``: a stock server with it (one request at
#: a time; its first pass only), a fresh ``--draft suffix`` server with it
#: (first and second pass).
SERVER_DRAFT_ARMS = ("server-stock-draft", "server-suffix-draft-cold", "server-suffix-draft-warm")
USAGE_DRAFTED = "draft_tokens"
USAGE_ACCEPTED = "accepted_draft_tokens"
# Tokens at the end of a prompt that identify it in a scripted processor.
ANCHOR_TOKENS = 48
BIAS = 1.0e4


# --------------------------------------------------------------------- BLAS
def blas_in_use() -> str:
    """``"openblas"`` when OpenBLAS is loaded in this process, else ``"reference"``
    (on macOS: ``"accelerate"``)."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open("/proc/self/maps") as f:
            return "openblas" if "libopenblas" in f.read() else "reference"
    except OSError:
        return "reference"


def maybe_reexec_with_openblas(blas: str, argv: Optional[List[str]] = None) -> None:
    """With ``blas="auto"`` or ``"openblas"`` on Linux, re-execute this process
    with OpenBLAS in ``LD_PRELOAD`` (once; the library must exist)."""
    if blas == "reference" or sys.platform != "linux" or os.environ.get(BLAS_ENV):
        return
    argv0 = (argv or sys.argv or [""])[0]
    if argv is None and not (
        os.path.basename(argv0) == "mlx-lm-suffix" or argv0.endswith("__main__.py")
    ):
        return  # not our CLI (e.g. a test runner): never replace the process
    if not os.path.exists(OPENBLAS):
        if blas == "openblas":
            raise RuntimeError(f"{OPENBLAS} not found: apt-get install -y libopenblas0-pthread")
        return
    if blas_in_use() == "openblas":
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (OPENBLAS, env.get("LD_PRELOAD")) if p)
    env[BLAS_ENV] = "openblas"
    if argv is None:
        argv = [sys.executable, argv0, *sys.argv[1:]]
        if argv0.endswith("__main__.py"):
            argv = [sys.executable, "-m", "mlx_lm_suffix", *sys.argv[1:]]
    sys.stdout.flush()
    os.execve(argv[0], argv, env)


def blas_env(blas: str) -> Dict[str, str]:
    """Environment for a subprocess (server) using the same BLAS policy."""
    env = dict(os.environ)
    if blas != "reference" and sys.platform == "linux" and os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = ":".join(p for p in (OPENBLAS, env.get("LD_PRELOAD")) if p)
    return env


# ------------------------------------------------------------- requests
@dataclass
class Request:
    """One workload request with its tokenization."""

    id: str
    workload: str
    session: str
    turn: int
    body: Dict[str, Any]  # {"messages": ...} or {"prompt": ...}
    reference: str
    prompt_ids: List[int] = field(default_factory=list)
    reference_ids: List[int] = field(default_factory=list)


def prompt_ids_for(tokenizer: Any, body: Dict[str, Any]) -> List[int]:
    """Token ids of a request as ``mlx_lm.server`` builds them."""
    if "messages" in body:
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        if isinstance(ids, str):
            ids = tokenizer.encode(ids, add_special_tokens=False)
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(body["prompt"])]


def load_requests(records: Sequence[Dict[str, Any]], tokenizer: Any) -> List[Request]:
    """Tokenize workload records (see :mod:`mlx_lm_suffix.tools.workloads`)."""
    out = []
    for r in records:
        body = {"messages": r["messages"]} if "messages" in r else {"prompt": r["prompt"]}
        req = Request(r["id"], r["workload"], str(r["session"]), int(r["turn"]), body, r["reference"])
        req.prompt_ids = prompt_ids_for(tokenizer, body)
        req.reference_ids = [int(t) for t in tokenizer.encode(r["reference"], add_special_tokens=False)]
        out.append(req)
    return out


# ------------------------------------------------------- scripted target
class ScriptedProcessor:
    """A logits processor that makes greedy output follow reference answers.

    For each entry ``(prompt_ids, reference_ids)`` it finds, in the token
    context it is given, the end of the prompt (its last ``anchor`` tokens)
    followed by a prefix of the reference, and adds a large bias to the next
    reference token (to EOS after the reference). Contexts matching no entry
    are left alone. Works with any context the caller passes (whole prompt
    plus output, or only an uncached tail of at least ``anchor`` tokens).
    """

    def __init__(
        self,
        entries: Sequence[Tuple[Sequence[int], Sequence[int]]],
        eos_id: int,
        anchor: int = ANCHOR_TOKENS,
    ):
        self.eos_id = int(eos_id)
        self._by_anchor: Dict[Tuple[int, ...], List[List[int]]] = {}
        self._anchor = anchor
        self._max_ref = 0
        pairs = [([int(t) for t in p], [int(t) for t in r]) for p, r in entries]
        for prompt, ref in pairs:
            # The shortest prompt tail (>= anchor) that no other entry with
            # another reference ends with.
            length = min(anchor, len(prompt))
            while length < len(prompt) and any(
                r2 != ref and len(p2) >= length and p2[-length:] == prompt[-length:]
                for p2, r2 in pairs
            ):
                length = min(len(prompt), length + 16)
            refs = self._by_anchor.setdefault(tuple(prompt[-length:]), [])
            if ref not in refs:
                refs.append(ref)
            self._max_ref = max(self._max_ref, len(ref))
        self._lens = sorted({len(k) for k in self._by_anchor})
        self.hits = 0
        self._last: Optional[Tuple[int, int, List[int]]] = None
        self._bias: Dict[Tuple[int, int, Any], Any] = {}

    def _follow(self, tokens: Any) -> Optional[int]:
        """The token after ``tokens`` by their length alone, once an earlier
        call found the request (None before, or past its reference).

        Reading the context would wait for the forward that sampled its last
        token, which mlx-lm queues before it calls the processors; greedy
        decoding with this bias follows the reference, so the length says
        where in it the context is."""
        if self._last is None:
            return None
        p, _, ref = self._last
        n = tokens.shape[-1] if hasattr(tokens, "shape") else len(tokens)
        if not p <= n <= p + len(ref):
            return None
        return ref[n - p] if n - p < len(ref) else self.eos_id

    def target(self, context: Sequence[int]) -> Optional[int]:
        """The token the script wants after ``context``, or None."""
        found = self.locate(context)
        if found is None:
            return None
        p, _, ref = found
        done = len(context) - p
        return ref[done] if done < len(ref) else self.eos_id

    def locate(self, context: Sequence[int]) -> Optional[Tuple[int, int, List[int]]]:
        """Where ``context`` follows an entry: ``(p, a, reference)``, the
        answer starting at ``context[p]`` after the entry's anchor of ``a``
        tokens, ``context[p:]`` a prefix of the reference; or None."""
        n = len(context)
        if self._last is not None:  # fast path: the match of the previous call
            p, a, ref = self._last
            done = context[p:]
            if p <= n and len(done) <= len(ref) and tuple(context[p - a : p]) in self._by_anchor:
                if list(ref[: len(done)]) == list(done):
                    return self._last
        lo = max(0, n - self._max_ref - 1)
        for p in range(n, lo - 1, -1):  # p: where the generated part starts
            for a in self._lens:
                if p < a:
                    continue
                refs = self._by_anchor.get(tuple(context[p - a : p]))
                if not refs:
                    continue
                done = context[p:]
                for ref in refs:
                    if len(done) <= len(ref) and list(ref[: len(done)]) == list(done):
                        self._last = (p, a, ref)
                        return self._last
        return None

    def expect(self, prompt_ids: Sequence[int], start: int) -> Optional[List[int]]:
        """The contexts this processor is given from now on begin ``start``
        tokens before the answer to ``prompt_ids`` (stock's speculative
        decoding hands its processors the prompt's last token and what
        follows: ``start=1``): they are followed by their length alone.
        Returns the reference (None: no entry's prompt; nothing changes)."""
        found = self.locate([int(t) for t in prompt_ids])
        if found is None:
            return None
        self._last = (start, 0, found[2])
        return found[2]

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        # The bench's measuring device: after the first call it costs no
        # wait and no reading (a step of a tiny model takes a millisecond).
        tok = self._follow(tokens)
        if tok is None:
            tok = self.target(_token_list(tokens))
        if tok is None:
            return logits
        self.hits += 1
        bias = self._bias.get((tok, logits.shape[-1], logits.dtype))
        if bias is None:  # one row per token, made once: a call is one addition
            bias = (mx.arange(logits.shape[-1]) == tok).astype(logits.dtype) * BIAS
            self._bias[(tok, logits.shape[-1], logits.dtype)] = bias
        return logits + bias


def _token_list(tokens: Any) -> List[int]:
    """A context as a list of ints (mlx arrays of shape ``(n,)`` or ``(1, n)``)."""
    context = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    if context and isinstance(context[0], list):  # batched (1, n)
        context = context[0]
    return context


# -------------------------------------------------------- scripted draft
#: Seed of the scripted draft model's agreement rule: the same for every
#: arm, every run and every process.
AGREEMENT_SEED = 0x5EED_D8AF
#: How far below the scripted draft token every other token of the wrapped
#: draft model's logits lies (:class:`ScriptedDraft`): far more than the
#: target's :data:`BIAS`, which stock's speculative decoding adds to the
#: draft's logits too (its processors run on both models' logits).
DRAFT_MARGIN = 1.0e9
_MASK64 = (1 << 64) - 1


def _mix(i: int, t: int) -> int:
    """A 64-bit hash of ``(i, t)`` (splitmix64's finaliser over both and
    :data:`AGREEMENT_SEED`): stable across processes, unlike ``hash``."""
    x = (i * 0x9E3779B97F4A7C15 + t * 0xC2B2AE3D27D4EB4F + AGREEMENT_SEED) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class DraftScript:
    """A scripted draft model's agreement with the scripted target.

    Where the target's script wants token ``t`` at position ``i`` of an
    answer (``i = 0`` its first token; the reference's end wants EOS), the
    draft model proposes ``t`` unless :meth:`token` marks the pair wrong: a
    seeded hash of ``(i, t)`` below ``1 - agreement``, so a fraction
    ``1 - agreement`` of positions, the same ones for every arm and every
    run; then it proposes another fixed token (never ``t``, never EOS).
    Two arms that draft with it see drafts of the same quality at the same
    positions: stock's speculative decoding through :class:`ScriptedDraft`,
    the plugin's :class:`~mlx_lm_suffix.sources.draft_model.DraftModel`
    through :meth:`guide`. After a wrong token of its own the guide goes on
    by position, with the same estimate: a draft model's confidence need
    not drop where it went wrong, and its estimates must not tell the
    policy which of its tokens fail (the draft model's own probabilities,
    a random model's, near zero, told it)."""

    #: Tokens of a context's head that key the answers found before.
    KEY = 16

    def __init__(self, entries: Sequence[Tuple[Sequence[int], Sequence[int]]], eos_id: int,
                 agreement: float, vocab_size: int, anchor: int = ANCHOR_TOKENS):
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"agreement must be in [0, 1], got {agreement}")
        self.agreement = float(agreement)
        self.eos_id = int(eos_id)
        self.vocab_size = int(vocab_size)
        self._locator = ScriptedProcessor(entries, eos_id, anchor)
        self._known: Dict[Tuple[int, ...], List[Tuple[int, Tuple[int, ...], List[int]]]] = {}

    def agrees(self, i: int, t: int) -> bool:
        """Whether the draft model proposes the target's ``t`` at answer
        position ``i``."""
        return (_mix(i, t) >> 11) / float(1 << 53) < self.agreement

    def token(self, i: int, t: int) -> int:
        """The draft model's token at answer position ``i`` where the
        target wants ``t``."""
        if self.agrees(i, t):
            return t
        wrong = (t + 1 + _mix(t, i) % (self.vocab_size - 1)) % self.vocab_size
        if wrong == self.eos_id:
            wrong = (wrong + 1) % self.vocab_size
            wrong = wrong if wrong != t else (wrong + 1) % self.vocab_size
        return wrong

    def wants(self, i: int, reference: Sequence[int]) -> Optional[int]:
        """The target's token at answer position ``i`` (EOS just after the
        reference; None past it)."""
        return reference[i] if i < len(reference) else self.eos_id if i == len(reference) else None

    def position(self, context: Sequence[int]) -> Optional[Tuple[int, List[int]]]:
        """``(i, reference)``: the context ends ``i`` tokens into the answer
        to a scripted prompt, found on the script (once; afterwards by
        length, on the script or off it after a wrong draft token); None
        elsewhere."""
        key = tuple(context[: self.KEY])
        n = len(context)
        for p, anchor, ref in self._known.get(key, ()):
            if p <= n and tuple(context[p - len(anchor) : p]) == anchor:
                return (n - p, ref) if n - p <= len(ref) else None
        found = self._locator.locate(context)
        if found is None:
            return None
        p, a, ref = found
        self._known.setdefault(key, []).append((p, tuple(context[p - a : p]), ref))
        return n - p, ref

    def guide(self, context: Sequence[int]) -> Optional[Tuple[int, float]]:
        """A :data:`~mlx_lm_suffix.sources.draft_model.Guide`: the scripted
        token after ``context`` and, as its estimate, the agreement (the
        chance that a token so proposed is the target's: calibrated on
        average, as a real draft model's would be, and no surer where it is
        wrong)."""
        found = self.position(context)
        if found is None:
            return None
        i, ref = found
        want = self.wants(i, ref)
        return None if want is None else (self.token(i, want), self.agreement)


def _fed(cache: Sequence[Any]) -> Optional[int]:
    """The positions a (single sequence's) cache list holds."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


class ScriptedDraft:
    """A draft model for stock mlx-lm's speculative decoding whose greedy
    tokens follow a :class:`DraftScript` (``script``; None: its own).

    It runs the real model's forward (its cost is what is measured), then
    puts every token but the scripted one :data:`DRAFT_MARGIN` below it in
    the last position's logits, which still depend on the forward. A
    position is counted from the draft cache's offset when the generation
    began (its first call: after the prompt's uncached tokens, the answer),
    so it stays right after stock trims the cache on a rejection, and where
    a stock server's cached prefix left the draft cache a token short of
    the target's (seen with mlx-lm 0.32.2: the draft model's own cache,
    which stock leaves so, whatever the script). The request is
    told by :meth:`expect`. Anything else is the model's (``layers``,
    ``args``, ``make_cache``)."""

    def __init__(self, model: Any, script: Optional[DraftScript] = None):
        self.model = model
        self.script = script
        self._answer: Optional[Tuple[int, List[int]]] = None
        self._start: Optional[int] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def expect(self, fed: int, reference_ids: Optional[Sequence[int]]) -> None:
        """The next generation feeds ``fed`` tokens (the prompt, less a
        cached prefix) and answers them with ``reference_ids`` (None: not
        scripted)."""
        self._answer = None if reference_ids is None else (fed, [int(t) for t in reference_ids])
        self._start = None

    def __call__(self, inputs: Any, cache: Optional[List[Any]] = None, **kwargs: Any) -> Any:
        logits = self.model(inputs, cache=cache, **kwargs)
        if self.script is None or self._answer is None or not cache:
            return logits
        offset = _fed(cache)
        if offset is None:
            return logits
        if self._start is None:
            self._start = offset - inputs.shape[-1]
        fed, ref = self._answer
        i = offset - self._start - fed
        want = None if i < 0 else self.script.wants(i, ref)
        if want is None:
            return logits
        import mlx.core as mx

        tok = self.script.token(i, want)
        return mx.where(mx.arange(logits.shape[-1]) == tok, logits, logits - DRAFT_MARGIN)


def stock_draft_counts(from_draft: Sequence[bool], num_draft_tokens: int, max_tokens: int
                       ) -> Tuple[int, int, int]:
    """``(drafted, accepted, rejected)`` of a stock speculative generation
    from its responses' ``from_draft`` flags (mlx-lm 0.32
    ``speculative_generate_step``: each round drafts ``min(max_tokens -
    generated, num_draft_tokens)`` tokens, yields the accepted ones, then
    the target's own token unless ``max_tokens`` is reached; a round that
    yields fewer than it drafted rejected one). A generation cut short (at
    EOS) counts its last round as far as it went."""
    drafted = accepted = rejected = 0
    i, n, total = 0, 0, len(from_draft)
    while i < total:
        k = min(max_tokens - n, num_draft_tokens)
        held = 0
        while i < total and from_draft[i] and held < k:
            held, i, n = held + 1, i + 1, n + 1
        drafted, accepted = drafted + k, accepted + held
        if i < total:  # the target's own token
            rejected += held < k
            i, n = i + 1, n + 1
    return drafted, accepted, rejected


class DraftCounts:
    """Draft tokens verified, accepted and drafts with a rejected token,
    per source (``model``, ``tree``, ``copy``): what the bench reports as
    a draft arm's acceptance (accepted / drafted) and agreement (accepted /
    (accepted + rejected): the chance that a draft token is accepted once
    every one before it was, the :class:`DraftScript`'s agreement)."""

    def __init__(self) -> None:
        self.by_source: Dict[str, Dict[str, int]] = {}
        self._lock = threading.Lock()

    def add(self, source: str, drafted: int = 0, accepted: int = 0, rejected: int = 0) -> None:
        with self._lock:
            c = self.by_source.setdefault(source, {"drafted": 0, "accepted": 0, "rejected": 0})
            c["drafted"] += drafted
            c["accepted"] += accepted
            c["rejected"] += rejected

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self.by_source.items()}

    def counting(self, record: Callable[..., None]) -> Callable[..., None]:
        """A drafter's bound ``record`` (:meth:`~mlx_lm_suffix.drafter.
        SuffixDrafter.record`, the one writer of its counts) that also
        counts here: a verified draft whose tokens did not all hold
        (``held < drafted``) had one rejected."""
        def counted(steps: int = 0, drafted: int = 0, accepted: int = 0, draft: Any = None,
                    held: Optional[int] = None, host_s: float = 0.0, replayed: Optional[int] = None,
                    source: str = "tree", last: int = 0) -> None:
            record(steps, drafted, accepted, draft, held, host_s, replayed, source, last)
            if drafted and draft is not None:
                self.add(draft.source, drafted=drafted,
                         rejected=int(held is not None and held < drafted))
            if accepted:
                self.add(source, accepted=accepted)
        counted.counted = True  # type: ignore[attr-defined]
        return counted


def counts_delta(after: Dict[str, Dict[str, int]], before: Dict[str, Dict[str, int]]
                 ) -> Dict[str, Dict[str, int]]:
    """Per source, ``after``'s counts less ``before``'s."""
    return {s: {k: v - before.get(s, {}).get(k, 0) for k, v in c.items()} for s, c in after.items()}


def model_figures(counts: Optional[Dict[str, int]]) -> Dict[str, Any]:
    """A draft model's counts as the report's figures: ``model_drafted``,
    ``model_accepted``, ``model_rejected``, ``model_acceptance`` (accepted /
    drafted) and ``model_agreement`` (accepted / (accepted + rejected)); all
    None without counts."""
    if counts is None:
        return dict.fromkeys(("model_drafted", "model_accepted", "model_rejected",
                              "model_acceptance", "model_agreement"))
    d, a, r = counts.get("drafted", 0), counts.get("accepted", 0), counts.get("rejected")
    return {
        "model_drafted": d,
        "model_accepted": a,
        "model_rejected": r,
        "model_acceptance": a / d if d else None,
        "model_agreement": a / (a + r) if r is not None and a + r else None,
    }


def write_script(path: str | os.PathLike, requests: Sequence[Request]) -> Path:
    """Write the script JSONL that :func:`serve_main` reads."""
    path = Path(path)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"prompt_ids": r.prompt_ids, "reference_ids": r.reference_ids}) + "\n")
    return path


def read_script(path: str | os.PathLike) -> List[Tuple[List[int], List[int]]]:
    """Entries of a script JSONL."""
    return [(d["prompt_ids"], d["reference_ids"]) for _, d in read_jsonl(path)]


def serve_main(argv: Optional[List[str]] = None) -> None:
    """``mlx_lm.server``'s main with scripted targets: every request's logits
    processors get a :class:`ScriptedProcessor` over ``$MLX_LM_SUFFIX_SCRIPT``
    (:func:`~mlx_lm_suffix.internals.add_logits_processors`, on the
    server's single and batched paths). With ``$MLX_LM_SUFFIX_DRAFT_COUNTS``
    a draft model's counts are written there and, with
    ``$MLX_LM_SUFFIX_DRAFT_AGREEMENT`` too, its tokens scripted
    (:func:`serve_draft_models`).
    A stock server listens with the suffix server's backlog
    (:class:`~mlx_lm_suffix.patches.server.ListeningServer`): stock's 5 makes
    clients beyond the sixth that connect at once wait a second, which would
    swamp what is compared.
    """
    import mlx_lm.server as server

    from .. import internals
    from ..patches.server import ListeningServer

    internals.serve_http_with(ListeningServer)
    script = os.environ.get(SCRIPT_ENV)
    entries = read_script(script) if script else None
    eos = int(os.environ.get("MLX_LM_SUFFIX_SCRIPT_EOS", "2"))
    if entries:
        internals.add_logits_processors(lambda args: [ScriptedProcessor(entries, eos)])
    counts = os.environ.get(DRAFT_COUNTS_ENV)
    if counts:
        agreement = os.environ.get(DRAFT_AGREEMENT_ENV)
        serve_draft_models(counts, entries if agreement else None, eos,
                           float(agreement) if agreement else DRAFT_AGREEMENT)
    if argv is not None:
        sys.argv = ["mlx_lm.server"] + argv
    server.main()


#: Environment variables of :func:`serve_main`: where a server writes its
#: draft model's counts (:class:`DraftCounts`, JSON), and the scripted
#: draft model's agreement.
DRAFT_COUNTS_ENV = "MLX_LM_SUFFIX_DRAFT_COUNTS"
DRAFT_AGREEMENT_ENV = "MLX_LM_SUFFIX_DRAFT_AGREEMENT"
#: Seconds between writes of a server's counts, and what a reader waits
#: for the last write.
COUNTS_INTERVAL = 0.1
COUNTS_SETTLE = 0.35


def serve_draft_models(counts_path: str, entries: Optional[List[Tuple[List[int], List[int]]]],
                       eos_id: int, agreement: float) -> None:
    """In this server process: count its draft model's drafts into
    ``counts_path`` (rewritten every :data:`COUNTS_INTERVAL` seconds while
    they change) and, with ``entries`` (the target's script), script its
    tokens with ``agreement`` (:class:`DraftScript`).

    A suffix server: every drafter given a draft model
    (:data:`~mlx_lm_suffix.patches.serving.DRAFTER_HOOKS`) gets the script's
    guide, and its counts are counted (:meth:`DraftCounts.counting`). A
    stock server (``--draft-model`` alone, one request at a time through
    ``stream_generate``): its draft model is wrapped in a
    :class:`ScriptedDraft` once loaded (``ModelProvider.load``), and each
    request's generation is told its whole prompt, which the server looks
    its prompt cache up with (``LRUPromptCache.fetch_nearest_cache``, in
    the same thread just before), and counted from its ``from_draft``
    flags (:func:`stock_draft_counts`)."""
    import mlx_lm.server as server
    from mlx_lm.models.cache import LRUPromptCache

    from ..patches import serving

    counts = DraftCounts()

    def script_for(draft: Any) -> Optional[DraftScript]:
        return DraftScript(entries, eos_id, agreement, output_size(draft)) if entries else None

    def on_drafter(drafter: SuffixDrafter) -> None:
        dm = drafter.draft_model
        dm.guide = getattr(script_for(dm.model), "guide", None)
        if not getattr(drafter.record, "counted", False):
            drafter.record = counts.counting(drafter.record)

    serving.DRAFTER_HOOKS.append(on_drafter)

    load = server.ModelProvider.load

    def load_scripted(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = load(self, *args, **kwargs)
        draft = self.draft_model
        if (draft is not None and not isinstance(draft, ScriptedDraft)
                and serving.state_for(self.cli_args) is None):
            self.draft_model = ScriptedDraft(draft, script_for(draft))
        return out

    server.ModelProvider.load = load_scripted
    prompts = threading.local()
    fetch = LRUPromptCache.fetch_nearest_cache

    def fetch_noting(self: Any, model: Any, tokens: Any) -> Any:
        prompts.value = list(tokens)
        return fetch(self, model, tokens)

    LRUPromptCache.fetch_nearest_cache = fetch_noting
    stream = server.stream_generate

    def stream_counted(*args: Any, **kwargs: Any) -> Any:
        draft = kwargs.get("draft_model")
        if not isinstance(draft, ScriptedDraft):
            return stream(*args, **kwargs)
        return _stock_draft_stream(stream, draft, getattr(prompts, "value", None), counts, args, kwargs)

    server.stream_generate = stream_counted
    threading.Thread(target=_write_counts, args=(counts, Path(counts_path)), daemon=True).start()


def _stock_draft_stream(stream: Callable[..., Any], draft: ScriptedDraft, prompt: Optional[List[int]],
                        counts: DraftCounts, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A stock server's speculative generation of a request whose whole
    prompt is ``prompt``: its scripted processors and draft model follow
    the request's reference; its draft counts go to ``counts``."""
    ref = None
    for p in kwargs.get("logits_processors") or ():
        if isinstance(p, ScriptedProcessor) and prompt is not None:
            ref = p.expect(prompt, 1) or ref  # (contexts from the prompt's last token)
    draft.expect(len(kwargs.get("prompt") or ()), ref)
    flags: List[bool] = []
    try:
        for resp in stream(*args, **kwargs):
            flags.append(bool(resp.from_draft))
            yield resp
    finally:
        d, a, r = stock_draft_counts(flags, kwargs.get("num_draft_tokens") or STOCK_DRAFT_TOKENS,
                                     kwargs.get("max_tokens", 256))
        counts.add("model", d, a, r)


def _write_counts(counts: DraftCounts, path: Path) -> None:
    last = None
    while True:
        snap = counts.snapshot()
        if snap != last:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(snap))
            os.replace(tmp, path)
            last = snap
        time.sleep(COUNTS_INTERVAL)


def read_counts(path: Optional[Path]) -> Dict[str, Dict[str, int]]:
    """A server's draft counts (see :func:`serve_draft_models`), after
    :data:`COUNTS_SETTLE` seconds for its last write; empty before any."""
    if path is None:
        return {}
    time.sleep(COUNTS_SETTLE)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------- oracle
class OracleDrafter(SuffixDrafter):
    """Drafts the exact reference continuation (an upper bound): call
    :meth:`set_reference` before each request. Single request at a time."""

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("max_cached_requests", 0)
        super().__init__(**kwargs)
        self._reference: List[int] = []
        self._done: Dict[int, int] = {}

    def set_reference(self, reference_ids: Sequence[int]) -> None:
        """The continuation the next request drafts from."""
        self._reference = [int(t) for t in reference_ids]

    def start(self, prompt: Sequence[int], scope: Any = None) -> int:
        req = super().start(prompt, scope)
        self._done[req] = 0
        return req

    def commit(self, req_id: int, tokens: Sequence[int], grow: bool = True) -> None:
        super().commit(req_id, tokens, grow)
        self._done[req_id] = self._done.get(req_id, 0) + len(tokens)

    def propose(self, req_id: int, max_tokens: Optional[int] = None) -> Draft:
        """The next ``max_tokens`` reference tokens."""
        limit = self.num_draft_tokens if max_tokens is None else max_tokens
        i = self._done.get(req_id, 0)
        toks = self._reference[i : i + max(0, limit)]
        return Draft(list(toks), [1.0] * len(toks))

    def finish(self, req_id: int) -> None:
        self._done.pop(req_id, None)
        super().finish(req_id)


# ------------------------------------------------------------ in-process
@dataclass
class Sample:
    """Measurements of one request."""

    tokens: int
    seconds: float
    ttft: float
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    matched: Optional[bool] = None
    #: Replays and the tokens they fed (None: no drafter), and their
    #: estimated seconds (None: no cost curve).
    replays: Optional[int] = None
    replayed_tokens: Optional[int] = None
    replay_seconds: Optional[float] = None
    #: Through a server: the prompt's tokens and those the server's prompt
    #: cache held (``usage.prompt_tokens_details.cached_tokens``).
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    #: The request's id (pairs it with another arm's sample of it).
    request: Optional[str] = None
    #: A draft model's draft tokens verified, accepted, and its drafts with
    #: a rejected token (``rejected`` None where not known), or None.
    model_counts: Optional[Dict[str, Optional[int]]] = None


def _peak_memory() -> Optional[int]:
    try:
        import mlx.core as mx

        return int(mx.get_peak_memory())
    except Exception:
        return None


def _reset_peak_memory() -> None:
    try:
        import mlx.core as mx

        mx.reset_peak_memory()
    except Exception:
        pass


def generate_one(
    model: Any,
    tokenizer: Any,
    req: Request,
    max_tokens: int,
    drafter: Optional[SuffixDrafter],
    scripted: bool,
    eos_id: int,
    num_draft_tokens: Optional[int] = None,
    draft: Optional["ScriptedDraft"] = None,
    counts: Optional[DraftCounts] = None,
) -> Tuple[Sample, List[int]]:
    """Generate one request with ``mlx_lm.stream_generate``; returns its
    sample and output tokens, the prompt prefilled in chunks of
    :data:`PREFILL_STEP_SIZE`. ``draft``: stock's speculative decoding with
    this draft model (``num_draft_tokens`` a round; no ``drafter``);
    ``counts``: the drafter's (:meth:`DraftCounts.counting`), whose
    ``model`` source the sample reports."""
    import mlx_lm

    kwargs: Dict[str, Any] = {"prefill_step_size": PREFILL_STEP_SIZE}
    if scripted:
        processor = ScriptedProcessor([(req.prompt_ids, req.reference_ids)], eos_id)
        if draft is not None:
            # Stock's speculative decoding hands its processors the
            # prompt's last token and what follows.
            processor.expect(req.prompt_ids, 1)
        kwargs["logits_processors"] = [processor]
    if draft is not None:
        if drafter is not None:
            raise ValueError("a stock draft model or a drafter, not both")
        draft.expect(len(req.prompt_ids), req.reference_ids if scripted else None)
        kwargs["draft_model"] = draft
        kwargs["num_draft_tokens"] = num_draft_tokens or STOCK_DRAFT_TOKENS
    if drafter is not None:
        kwargs["draft_model"] = drafter
        if num_draft_tokens is not None:
            kwargs["num_draft_tokens"] = num_draft_tokens
        if isinstance(drafter, OracleDrafter):
            drafter.set_reference(req.reference_ids)
        before = drafter.stats.copy()
        counted = counts.snapshot() if counts is not None else None
    out: List[int] = []
    flags: List[bool] = []
    t0 = time.perf_counter()
    ttft = 0.0
    forwards = 0  # stock's: one per token generated, an EOS included
    for resp in mlx_lm.stream_generate(model, tokenizer, req.prompt_ids, max_tokens=max_tokens, **kwargs):
        if not out and resp.generation_tokens:
            ttft = time.perf_counter() - t0
        forwards += 1
        flags.append(bool(getattr(resp, "from_draft", False)))
        if resp.finish_reason != "stop" or resp.token not in tokenizer.eos_token_ids:
            out.append(int(resp.token))
    seconds = time.perf_counter() - t0
    s = Sample(tokens=len(out), seconds=seconds, ttft=ttft, steps=forwards, request=req.id)
    if draft is not None:
        d, a, r = stock_draft_counts(flags, kwargs["num_draft_tokens"], max_tokens)
        s.drafted, s.accepted, s.steps = d, a, forwards - a
        s.model_counts = {"drafted": d, "accepted": a, "rejected": r}
    if drafter is not None:
        moved = drafter.stats.delta(before)
        s.drafted, s.accepted, s.steps = moved.drafted, moved.accepted, moved.steps
        s.replays, s.replayed_tokens = moved.replays, moved.replayed_tokens
        s.replay_seconds = replay_seconds(drafter, moved.replays, moved.replayed_tokens)
        if counts is not None:
            s.model_counts = counts_delta(counts.snapshot(), counted).get(
                "model", {"drafted": 0, "accepted": 0, "rejected": 0})
    if scripted:
        s.matched = out == req.reference_ids[: len(out)] and (
            len(out) == min(max_tokens, len(req.reference_ids))
        )
    return s, out


def replay_seconds(drafter: SuffixDrafter, replays: int, tokens: int) -> Optional[float]:
    """Estimated seconds of ``replays`` forwards over ``tokens`` in all,
    from the drafter's cost curve (each as wide as their mean); None
    without a curve."""
    cost = drafter.policy.cost
    if cost is None:
        return None
    return replays * cost(max(1, round(tokens / replays))) if replays else 0.0


@dataclass
class DraftSetup:
    """The draft model of the draft arms: the small model, its
    :class:`DraftScript` (None: unscripted) and stock's draft tokens a
    round."""

    model: Any
    script: Optional[DraftScript] = None
    stock_tokens: int = 3


def arm_drafter(arm: str, drafter_kwargs: Optional[Dict[str, Any]] = None,
                draft: Optional[DraftSetup] = None) -> Optional[SuffixDrafter]:
    """A fresh drafter for in-process ``arm`` (None for ``stock`` and
    ``stock-draft``); ``draft``: the draft arms' draft model."""
    drafter_kwargs = drafter_kwargs or {}
    if arm in DRAFT_ARMS:
        if draft is None:
            raise ValueError(f"arm {arm!r} needs a draft model")
        if arm == "stock-draft":
            return None
        from ..sources.draft_model import DraftModel

        guide = draft.script.guide if draft.script is not None else None
        return SuffixDrafter(draft_model=DraftModel(draft.model, guide), **drafter_kwargs)
    if arm in ("suffix-cold", "suffix-warm"):
        return SuffixDrafter(**drafter_kwargs)
    if arm in ("suffix-cold-fixed", "suffix-warm-fixed"):
        return SuffixDrafter(**{**drafter_kwargs, "policy": "fixed"})
    if arm == "oracle":
        return OracleDrafter(**{**drafter_kwargs, "policy": "fixed"})
    if oracle_length(arm) is not None:
        return OracleDrafter(
            **{**drafter_kwargs, "policy": "fixed", "num_draft_tokens": oracle_length(arm)}
        )
    if arm != "stock":
        raise ValueError(f"unknown in-process arm {arm!r}")
    return None


def run_inprocess_arms(
    arms: Sequence[str],
    model: Any,
    tokenizer: Any,
    requests: Sequence[Request],
    max_tokens: int,
    scripted: bool,
    eos_id: int,
    drafter_kwargs: Optional[Dict[str, Any]] = None,
    tick: Callable[[], None] = lambda: None,
    draft: Optional[DraftSetup] = None,
) -> Dict[str, Dict[str, Any]]:
    """Run ``requests`` (in order) through every in-process arm, interleaved:
    each request goes through all arms in turn, in an order that alternates
    from request to request, so that the machine's drift over the run weighs
    on every arm alike. Each arm keeps its own drafter across the requests.
    ``matched_reference``: in scripted mode, whether the output followed the
    reference; otherwise (real output), whether it equals stock's tokens.
    ``draft``: the draft arms' draft model (``stock-draft``: stock's
    speculative decoding with it; ``suffix-draft``: a drafter with it beside
    the trees)."""
    drafters = {a: arm_drafter(a, drafter_kwargs, draft) for a in arms}
    stock_draft = ScriptedDraft(draft.model, draft.script) if draft is not None else None
    counts = {a: DraftCounts() for a, d in drafters.items() if d is not None and d.draft_model is not None}
    calibrated = {}
    for a, drafter in drafters.items():
        if drafter is None:
            continue
        if a in counts:
            drafter.record = counts[a].counting(drafter.record)
            # The costs are measured at first use: out of the timings.
            drafter.policy.ensure_cost(drafter.draft_model.pair(model))
            drafter.policy.ensure_draft_cost(drafter.draft_model.model)
        drafter.policy.ensure_cost(model)  # the cost calibration stays out of the timings
        cost = drafter.policy.cost
        calibrated[a] = (cost.relative(), cost(1)) if cost is not None else (None, None)
        if a.startswith("suffix-warm"):  # replay once, untimed
            for req in requests:
                generate_one(model, tokenizer, req, max_tokens, drafter, scripted, eos_id)
    samples: Dict[str, List[Sample]] = {a: [] for a in arms}
    peaks: Dict[str, Optional[int]] = {a: None for a in arms}
    for i, req in enumerate(requests):
        outs = {}
        for a in arms if i % 2 == 0 else list(reversed(arms)):
            _reset_peak_memory()
            if a == "stock-draft":
                s, outs[a] = generate_one(model, tokenizer, req, max_tokens, None, scripted, eos_id,
                                          draft.stock_tokens, draft=stock_draft)
            else:
                s, outs[a] = generate_one(model, tokenizer, req, max_tokens, drafters[a], scripted,
                                          eos_id, counts=counts.get(a))
            peak = _peak_memory()
            if peak is not None:
                peaks[a] = max(peaks[a] or 0, peak)
            samples[a].append(s)
            tick()
        if not scripted and "stock" in outs:
            # Real output: each arm's tokens against stock's.
            for a in arms:
                if a != "stock":
                    samples[a][-1].matched = outs[a] == outs["stock"]
    out = {a: summarize(samples[a], peak_memory=peaks[a]) for a in arms}
    for a, drafter in drafters.items():
        if drafter is not None:
            cost = drafter.policy.cost
            out[a]["verify_cost"] = cost.relative() if cost is not None else None
            out[a]["plain_step_s"] = cost(1) if cost is not None else None
            out[a]["idle_s_per_wait"] = drafter.policy.wait_s
            out[a]["calibrated_cost"], out[a]["calibrated_step_s"] = calibrated[a]
    return out


def oracle_length(arm: str) -> Optional[int]:
    """``N`` of an ``oracle@N`` arm, else None."""
    name, _, n = arm.partition("@")
    return int(n) if name == "oracle" and n.isdigit() and int(n) > 0 else None


def is_inprocess_arm(arm: str) -> bool:
    """Whether ``arm`` names an in-process arm."""
    return arm in INPROCESS_ARMS or oracle_length(arm) is not None


def summarize(
    samples: Sequence[Sample], wall: Optional[float] = None, peak_memory: Optional[int] = None
) -> Dict[str, Any]:
    """Aggregate metrics of one arm run. ``wall`` defaults to the sum of the
    request times (concurrency 1). ``per_request``: each sample with a
    request id, by id, its own ``tokens_per_s`` and ``decode_tokens_per_s``
    (None with fewer than 2 tokens); ids are expected to be unique."""
    tokens = sum(s.tokens for s in samples)
    wall = wall if wall is not None else sum(s.seconds for s in samples)
    drafted = sum(s.drafted for s in samples)
    accepted = sum(s.accepted for s in samples)
    steps = sum(s.steps for s in samples)
    tpots = [(s.seconds - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    matched = [s.matched for s in samples if s.matched is not None]
    replays = [s for s in samples if s.replays is not None]
    replay_s = [s.replay_seconds for s in replays if s.replay_seconds is not None]
    served = [s for s in samples if s.prompt_tokens is not None]
    return {
        "requests": len(samples),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        # Generation throughput after the first token (prefill excluded), as
        # mlx-lm's "Generation: ... tokens-per-sec".
        "decode_tokens_per_s": _decode_rate(samples),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "steps": steps,
        "tokens_per_step": tokens / steps if steps else None,
        "ttft_s": statistics.mean(s.ttft for s in samples) if samples else None,
        "tpot_s": statistics.mean(tpots) if tpots else None,
        "peak_memory_bytes": peak_memory,
        "matched_reference": all(matched) if matched else None,
        "replays": sum(s.replays for s in replays) if replays else None,
        "replayed_tokens": sum(s.replayed_tokens for s in replays) if replays else None,
        "replay_share": sum(replay_s) / wall if replay_s and wall > 0 else None,
        "prompt_tokens": sum(s.prompt_tokens for s in served) if served else None,
        "cached_prompt_tokens": sum(s.cached_tokens or 0 for s in served) if served else None,
        **model_figures(_model_sum(samples)),
        "per_request": {
            s.request: {
                "tokens_per_s": s.tokens / s.seconds if s.seconds > 0 else 0.0,
                "decode_tokens_per_s": _decode_rate([s]),
            }
            for s in samples
            if s.request is not None
        },
    }


def _model_sum(samples: Sequence[Sample]) -> Optional[Dict[str, Optional[int]]]:
    """The samples' draft model counts summed (None: none has any;
    ``rejected`` None unless every sample knows it)."""
    known = [s.model_counts for s in samples if s.model_counts is not None]
    if not known:
        return None
    rejected = [c.get("rejected") for c in known]
    return {
        "drafted": sum(c.get("drafted") or 0 for c in known),
        "accepted": sum(c.get("accepted") or 0 for c in known),
        "rejected": None if None in rejected else sum(rejected),
    }


def _decode_rate(samples: Sequence[Sample]) -> Optional[float]:
    decode = sum(s.seconds - s.ttft for s in samples if s.tokens > 1)
    tokens = sum(s.tokens - 1 for s in samples if s.tokens > 1)
    return tokens / decode if decode > 0 else None


#: The per-request rates :func:`summarize` reports, by the name of their ratio.
RATE_KEYS = {"end_to_end": "tokens_per_s", "decode": "decode_tokens_per_s"}


def request_ratios(arm: Dict[str, Any], base: Dict[str, Any], key: str) -> Dict[str, float]:
    """Per request id that both summaries (of :func:`summarize`) hold, the
    arm's rate ``key`` over the base's, in the arm's request order; requests
    without both rates are left out."""
    out = {}
    base_rates = base.get("per_request") or {}
    for rid, rates in (arm.get("per_request") or {}).items():
        mine, theirs = rates.get(key), (base_rates.get(rid) or {}).get(key)
        if mine is not None and theirs:
            out[rid] = mine / theirs
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly
    between order statistics (``statistics.quantiles``' inclusive method);
    ``ValueError`` when empty."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio_spread(ratios: Dict[str, Sequence[float]]) -> Dict[str, Any]:
    """The spread over requests of per-request ratios (request id -> its
    ratio in each repetition): each request counts as the median of its
    ratios; returns ``requests`` (how many had one), their ``median``,
    ``p10`` (:func:`percentile`), ``worst`` (the lowest),
    ``worst_request`` (its id, the first in order on a tie) and the
    ``ratios`` given; None figures when no request has a ratio."""
    per = {rid: statistics.median(v) for rid, v in ratios.items() if v}
    worst = min(per, key=per.__getitem__) if per else None
    return {
        "requests": len(per),
        "median": statistics.median(per.values()) if per else None,
        "p10": percentile(list(per.values()), 10) if per else None,
        "worst": per[worst] if worst is not None else None,
        "worst_request": worst,
        "ratios": {rid: list(v) for rid, v in ratios.items()},
    }


def request_spreads(reps: Sequence[Dict[str, Dict[str, Any]]], arm: str, base: str) -> Dict[str, Any]:
    """``arm``'s per-request ratios to ``base`` over repetitions ``reps``
    (arm name -> :func:`summarize` output, one dict per repetition), each
    request against ``base``'s same request in the same repetition: a
    :func:`ratio_spread` for each ratio of :data:`RATE_KEYS`."""
    out = {}
    for name, key in RATE_KEYS.items():
        ratios: Dict[str, List[float]] = {}
        for rep in reps:
            if arm in rep and base in rep:
                for rid, r in request_ratios(rep[arm], rep[base], key).items():
                    ratios.setdefault(rid, []).append(r)
        out[name] = ratio_spread(ratios)
    return out


# ----------------------------------------------------------------- server
def server_process(
    model_path: str,
    *,
    suffix: bool,
    script: Optional[Path] = None,
    eos_id: int = 2,
    blas: str = "auto",
    extra_args: Sequence[str] = (),
    log: Optional[Path] = None,
    ranks: int = 1,
    draft_counts: Optional[Path] = None,
    draft_agreement: Optional[float] = None,
) -> ServerProcess:
    """A ready ``mlx_lm.server`` (``--draft suffix`` when ``suffix``) run by
    :func:`serve_main` with the BLAS policy ``blas`` and, with ``script``,
    scripted targets, on ``ranks`` processes of this machine (more than one:
    by ``mlx.launch``, the model sharded); its output is appended to ``log``.
    ``draft_counts``: where it writes its draft model's counts (a server
    with ``--draft-model``), ``draft_agreement``: its draft model's
    scripted agreement (see :func:`serve_draft_models`).
    Stop it, or use it as a context manager."""
    env = blas_env(blas)
    if script is not None:
        env[SCRIPT_ENV] = str(script)
        env["MLX_LM_SUFFIX_SCRIPT_EOS"] = str(eos_id)
    if draft_counts is not None:
        env[DRAFT_COUNTS_ENV] = str(draft_counts)
        if draft_agreement is not None and script is not None:
            env[DRAFT_AGREEMENT_ENV] = str(draft_agreement)
    args = ["--draft", "suffix"] if suffix else []
    command = distributed_command(ranks, server=SERVE_MAIN) if ranks > 1 else SERVE_MAIN
    return ServerProcess(
        model_path, *args, *extra_args, command=command, env=env, log=log, append_log=True,
        process_group=ranks > 1,
    )


#: Connection attempts per request (see :func:`_open`).
CONNECT_ATTEMPTS = 20


#: How a connection reset unread shows: while the response is awaited, or
#: while the request is still being sent (a broken pipe, which urlopen wraps
#: in a URLError).
_UNREAD = (ConnectionResetError, ConnectionRefusedError, BrokenPipeError)


def _open(hreq: urllib.request.Request, timeout: float) -> Any:
    """``urlopen``, again after a connection reset before any response (a
    server that was never told of it: a stock ``mlx_lm.server`` outside
    :func:`serve_main` listens with socketserver's backlog of 5). The time
    of the failed attempts counts in the request's."""
    for attempt in range(1, CONNECT_ATTEMPTS):
        try:
            return urllib.request.urlopen(hreq, timeout=timeout)
        except _UNREAD:
            pass
        except urllib.error.URLError as e:
            if not isinstance(e.reason, _UNREAD):
                raise
        time.sleep(0.05 * attempt)  # back off, as HTTP clients do
    return urllib.request.urlopen(hreq, timeout=timeout)


def http_generate(url: str, req: Request, max_tokens: int, timeout: float = 600.0) -> Tuple[Sample, str]:
    """Send one request (streaming, greedy) and measure it."""
    body = dict(req.body)
    body.update(
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    data = json.dumps(body).encode()
    hreq = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage: Dict[str, Any] = {}
    with _open(hreq, timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    seconds = time.perf_counter() - t0
    n = int(usage.get("completion_tokens", 0))
    drafted = int(usage.get(USAGE_DRAFTED, 0) or 0)
    accepted = int(usage.get(USAGE_ACCEPTED, 0) or 0)
    steps = n - accepted if n else 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    by_source = usage.get(USAGE_DRAFTED + "_by_source")
    sample = Sample(
        n,
        seconds,
        ttft or seconds,
        drafted,
        accepted,
        steps,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(cached or 0),
        request=req.id,
    )
    if by_source is not None and "model" in by_source:  # (rejections not known here)
        accepted_by = usage.get(USAGE_ACCEPTED + "_by_source") or {}
        sample.model_counts = {"drafted": int(by_source.get("model", 0)),
                               "accepted": int(accepted_by.get("model", 0)), "rejected": None}
    return sample, "".join(text)


def run_server_arms(
    urls: Dict[str, str],
    requests: Sequence[Request],
    max_tokens: int,
    concurrency: int,
    scripted: bool,
    tick: Callable[[], None] = lambda: None,
) -> Dict[str, Dict[str, Any]]:
    """Send the workload to every server of ``urls`` (name -> base URL) with
    ``concurrency`` sessions in flight (the turns of a session stay in
    order), interleaved: the sessions go in waves of ``concurrency``, each
    wave to every server in turn, in an order that alternates from wave to
    wave, so that the machine's drift weighs on every server alike. A
    server's time is the sum of its waves'. ``matched_reference``: the
    stock server's, as for :func:`run_inprocess_arms`; every other server's,
    whether each answer's text is the stock server's (scripted or not: where
    the script cannot steer a request, a prompt cache's hit leaving its
    processors too short a context, the model's own output is compared)."""
    sessions: Dict[str, List[Request]] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    groups = list(sessions.values())
    names = list(urls)
    samples: Dict[str, List[Sample]] = {n: [] for n in names}
    walls = dict.fromkeys(names, 0.0)
    lock = threading.Lock()

    texts: Dict[str, Dict[int, Tuple[Sample, str]]] = {n: {} for n in names}

    def run_session(name: str, reqs: List[Request]) -> None:
        for r in reqs:
            s, text = http_generate(urls[name], r, max_tokens)
            if scripted:
                s.matched = r.reference.startswith(text) and len(text) > 0
            with lock:
                samples[name].append(s)
                texts[name][id(r)] = s, text
            tick()

    for w, start in enumerate(range(0, len(groups), concurrency)):
        wave = groups[start : start + concurrency]
        for name in names if w % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                for f in [pool.submit(run_session, name, reqs) for reqs in wave]:
                    f.result()
            walls[name] += time.perf_counter() - t0
    if "stock" in texts:
        # Each server's answer against the stock server's.
        for name in names:
            if name != "stock":
                for key, (s, text) in texts[name].items():
                    s.matched = text == texts["stock"][key][1]
    return {n: summarize(samples[n], wall=walls[n]) for n in names}


def server_stats(url: str) -> Optional[Dict[str, Any]]:
    """The suffix server's stats endpoint, or None."""
    try:
        with urllib.request.urlopen(url + STATS_PATH, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ driver
def is_local_random_model(path: str) -> bool:
    """True for a model folder built by :mod:`mlx_lm_suffix.tools.models`
    (not for the real models converted by :mod:`mlx_lm_suffix.tools.gguf`,
    which share its cache)."""
    from .cache import cache_root
    from .gguf import is_converted

    try:
        p = Path(path).resolve()
        if is_converted(p):
            return False
        return (cache_root() / "models").resolve() in p.parents or "mlx_lm_suffix" in str(p)
    except OSError:
        return False


def _merge(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Median of numeric fields over repetitions."""
    out: Dict[str, Any] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals and len(vals) == len(runs):
            out[k] = statistics.median(vals)
        elif k == "matched_reference":
            ms = [r[k] for r in runs if r[k] is not None]
            out[k] = all(ms) if ms else None
        else:
            out[k] = runs[0][k]
    return out


def run_bench(
    model_path: str,
    workload_files: Dict[str, Path],
    *,
    arms: Sequence[str] = DEFAULT_ARMS,
    server: bool = False,
    concurrency: Sequence[int] = (1, 8),
    server_fixed: bool = False,
    repetitions: int = 3,
    max_tokens: int = 256,
    max_requests: Optional[int] = None,
    scripted: bool = True,
    blas: str = "auto",
    drafter_kwargs: Optional[Dict[str, Any]] = None,
    progress: Optional[Callable[[int], None]] = None,
    log_dir: Optional[Path] = None,
    ranks: int = 1,
    draft_model_path: Optional[str] = None,
    draft_agreement: float = DRAFT_AGREEMENT,
    stock_draft_tokens: int = STOCK_DRAFT_TOKENS,
) -> Dict[str, Any]:
    """Run every arm on every workload; returns the JSON report (see module
    doc); ``ranks``: the servers' processes (see :func:`server_process`);
    ``draft_model_path``: the draft arms' draft model (of the model's
    vocabulary, else :class:`DraftModelMismatch`), scripted to agree with
    the scripted target on ``draft_agreement`` of its tokens
    (:class:`DraftScript`); stock drafts ``stock_draft_tokens`` a round."""
    import mlx_lm

    needs = [a for a in arms if a in DRAFT_ARMS]
    if needs and draft_model_path is None:
        raise DraftModelMismatch(f"arms {needs} need a draft model")
    model, tokenizer = mlx_lm.load(str(model_path))
    eos_id = sorted(tokenizer.eos_token_ids)[0] if tokenizer.eos_token_ids else 0
    small = None
    if draft_model_path is not None:
        small, _ = mlx_lm.load(str(draft_model_path))
        problem = vocabulary_problem(model, small)
        if problem:
            raise DraftModelMismatch(problem)
    tick = (lambda: progress(1)) if progress else (lambda: None)
    report: Dict[str, Any] = {
        "mode": "scripted" if scripted else "real",
        "blas": blas_in_use(),
        "model": str(model_path),
        "platform": f"{platform.system()} {platform.machine()}",
        "max_tokens": max_tokens,
        "repetitions": repetitions,
        "ranks": ranks,
        "drafter": SuffixDrafter(**(drafter_kwargs or {})).config(),
        "draft_model": None if draft_model_path is None else {
            "model": str(draft_model_path),
            "agreement": draft_agreement if scripted else None,
            "stock_draft_tokens": stock_draft_tokens,
        },
        "workloads": {},
    }
    workloads = {}
    for name, path in workload_files.items():
        recs = read_workload(path)[: max_requests or None]
        workloads[name] = load_requests(recs, tokenizer)

    # Warm-up (first-call compile/allocation costs stay out of the numbers).
    first = next(iter(workloads.values()))[0]
    generate_one(model, tokenizer, first, 4, None, scripted, eos_id)
    if small is not None:
        generate_one(model, tokenizer, first, 4, None, scripted, eos_id, stock_draft_tokens,
                     draft=ScriptedDraft(small))

    tmp = Path(tempfile.mkdtemp(prefix="mlx_lm_suffix_bench_"))
    for name, requests in workloads.items():
        wl: Dict[str, Any] = {
            "requests": len(requests),
            "reference_tokens": sum(min(len(r.reference_ids), max_tokens) for r in requests),
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "arms": {},
        }
        draft = None
        if small is not None:
            script = DraftScript([(r.prompt_ids, r.reference_ids) for r in requests], eos_id,
                                 draft_agreement, output_size(small)) if scripted else None
            draft = DraftSetup(small, script, stock_draft_tokens)
        per_rep: List[Dict[str, Dict[str, Any]]] = []
        for rep in range(repetitions):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            per_rep.append(
                run_inprocess_arms(order, model, tokenizer, requests, max_tokens, scripted, eos_id,
                                   drafter_kwargs, tick, draft)
            )
        if server:
            script = write_script(tmp / f"{name}.script.jsonl", requests) if scripted else None
            for c in concurrency:
                for rep in range(repetitions):
                    res = _server_rep(model_path, requests, max_tokens, c, scripted, script, eos_id, blas, rep, tick, log_dir, server_flags(drafter_kwargs), server_fixed, ranks,
                                      draft_model_path, draft_agreement if scripted else None, stock_draft_tokens, tmp)
                    per_rep[rep].update({f"{k}@c{c}": v for k, v in res.items()})
        all_arms = list(per_rep[0])
        for a in all_arms:
            merged = _merge([rep[a] for rep in per_rep if a in rep])
            base = baseline_arm(a)
            ratios = [
                rep[a]["tokens_per_s"] / rep[base]["tokens_per_s"]
                for rep in per_rep
                if a in rep and base in rep and rep[base]["tokens_per_s"] > 0
            ]
            merged["speedup_vs_stock"] = statistics.median(ratios) if ratios else None
            merged["speedup_per_rep"] = ratios
            decode = [
                rep[a]["decode_tokens_per_s"] / rep[base]["decode_tokens_per_s"]
                for rep in per_rep
                if a in rep and base in rep
                and rep[a]["decode_tokens_per_s"] and rep[base]["decode_tokens_per_s"]
            ]
            merged["decode_speedup_vs_stock"] = statistics.median(decode) if decode else None
            merged["decode_speedup_per_rep"] = decode
            merged["decode_tokens_per_s_per_rep"] = [rep[a].get("decode_tokens_per_s") for rep in per_rep
                                                     if a in rep]
            if "verify_cost" in per_rep[0][a]:
                merged["costs_per_rep"] = [{k: rep[a][k] for k in REP_COSTS} for rep in per_rep]
            if "server_stats" in per_rep[0][a]:
                merged["server_stats_per_rep"] = [rep[a].get("server_stats") for rep in per_rep
                                                  if a in rep]
            merged["per_request"] = request_spreads(per_rep, a, base) if a != base else None
            wl["arms"][a] = merged
        report["workloads"][name] = wl
    return report


class DraftModelMismatch(ValueError):
    """A draft model the bench cannot use (another vocabulary), or draft
    arms without one."""


def output_size(model: Any) -> int:
    """The length of ``model``'s logits (its vocabulary)."""
    import mlx.core as mx

    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if isinstance(size, int):
        return size
    return int(model(mx.array([[0]], mx.uint32)).shape[-1])


def baseline_arm(arm: str) -> str:
    """The stock arm that ``arm``'s speedups are measured against: in process,
    ``stock``; a server's first pass, the stock server's first pass
    (``server-stock@cN``); a server's second (warm) pass, the stock server's
    second pass, whose prompt cache is as warm (``server-stock-warm@cN``)."""
    if not arm.startswith("server-"):
        return "stock"
    name, _, c = arm.partition("@")
    warm = "warm" in name.split("-")
    return ("server-stock-warm@" if warm else "server-stock@") + c


WARM_UP = Request("warm-up", "warm-up", "warm-up", 0, {"prompt": "Warm-up."}, "")


def warm_up(url: str) -> None:
    """One short request unrelated to the workloads, so that model loading,
    the cost calibration and first-call compilation stay out of the timings
    of both servers alike."""
    http_generate(url, WARM_UP, 4)


def server_flags(drafter_kwargs: Optional[Dict[str, Any]]) -> List[str]:
    """``mlx_lm.server`` flags for the drafter settings of the in-process arms."""
    flags = []
    for k, v in (drafter_kwargs or {}).items():
        name = k if k == "num_draft_tokens" else f"suffix_{k}"
        flags += [f"--{name.replace('_', '-')}", str(v)]
    return flags


def _server_rep(
    model_path: str,
    requests: Sequence[Request],
    max_tokens: int,
    concurrency: int,
    scripted: bool,
    script: Optional[Path],
    eos_id: int,
    blas: str,
    rep: int,
    tick: Callable[[], None],
    log_dir: Optional[Path],
    suffix_args: Sequence[str] = (),
    fixed: bool = False,
    ranks: int = 1,
    draft: Optional[str] = None,
    draft_agreement: Optional[float] = None,
    stock_draft_tokens: int = STOCK_DRAFT_TOKENS,
    counts_dir: Optional[Path] = None,
) -> Dict[str, Dict[str, Any]]:
    """One repetition of the server arms: a stock server and a fresh suffix
    server (started with ``suffix_args``), and with ``fixed`` a fresh
    ``--suffix-policy fixed`` server, and with ``draft`` (a draft model) a
    stock server and a fresh suffix server with ``--draft-model draft``, all
    running at once; the workload goes through them interleaved
    (:func:`run_server_arms`) twice, cold then warm (the stock server with a
    draft model, which serves one request at a time, cold only). The start
    order alternates between repetitions."""
    servers = [("stock", False, ()), ("suffix", True, suffix_args)]
    if fixed:
        servers.append(("suffix-fixed", True, (*suffix_args, "--suffix-policy", "fixed")))
    if draft is not None:
        servers.append(("stock-draft", False, ("--draft-model", draft,
                                               "--num-draft-tokens", str(stock_draft_tokens))))
        servers.append(("suffix-draft", True, (*suffix_args, "--draft-model", draft)))
    if rep % 2:
        servers.reverse()
    counts: Dict[str, Path] = {}
    with ExitStack() as stack:
        urls = {}
        for name, suffix, args in servers:
            log = log_dir / f"server-{name}.log" if log_dir else None
            if name.endswith("-draft"):
                folder = counts_dir or Path(tempfile.mkdtemp(prefix="mlx_lm_suffix_counts_"))
                counts[name] = folder / f"{name}-c{concurrency}-r{rep}.counts.json"
                counts[name].unlink(missing_ok=True)
            urls[name] = stack.enter_context(
                server_process(model_path, suffix=suffix, script=script, eos_id=eos_id, blas=blas, log=log,
                               extra_args=args, ranks=ranks, draft_counts=counts.get(name),
                               draft_agreement=draft_agreement)
            ).url
            warm_up(urls[name])
        before = {n: read_counts(c) for n, c in counts.items()}
        cold = run_server_arms(urls, requests, max_tokens, concurrency, scripted, tick)
        after_cold = {n: read_counts(c) for n, c in counts.items()}
        # (the cold pass's curves and counts: each repetition's servers are fresh)
        cold_stats = {n: server_stats(u) for n, u in urls.items()
                      if n not in ("stock", "stock-draft")}
        # Second pass: the stock server's prompt cache is now as warm as the
        # suffix servers' in theirs, so they compare fairly.
        warm = run_server_arms({n: u for n, u in urls.items() if n != "stock-draft"}, requests,
                               max_tokens, concurrency, scripted, tick)
        after_warm = {n: read_counts(c) for n, c in counts.items() if n != "stock-draft"}
        stats = {n: server_stats(u) for n, u in urls.items() if n not in ("stock", "stock-draft")}
    for name, done in after_cold.items():
        delta = counts_delta(done, before[name]).get("model")
        cold[name].update(model_figures(delta or {"drafted": 0, "accepted": 0, "rejected": 0}))
    for name, done in after_warm.items():
        delta = counts_delta(done, after_cold[name]).get("model")
        warm[name].update(model_figures(delta or {"drafted": 0, "accepted": 0, "rejected": 0}))
    out = {"server-stock": cold["stock"], "server-stock-warm": warm["stock"]}
    for name, tag in (("suffix", ""), ("suffix-fixed", "-fixed")):
        if name in urls:
            out[f"server-suffix-cold{tag}"] = cold[name]
            out[f"server-suffix-warm{tag}"] = warm[name]
            cold[name]["server_stats"] = cold_stats[name]
            warm[name]["server_stats"] = stats[name]
    if draft is not None:
        out["server-stock-draft"] = cold["stock-draft"]
        out["server-suffix-draft-cold"] = cold["suffix-draft"]
        out["server-suffix-draft-warm"] = warm["suffix-draft"]
        cold["suffix-draft"]["server_stats"] = cold_stats["suffix-draft"]
        warm["suffix-draft"]["server_stats"] = stats["suffix-draft"]
    return out


def total_ticks(n_requests: Dict[str, int], arms: Sequence[str], repetitions: int, server: bool,
                concurrency: Sequence[int], server_fixed: bool = False, draft: bool = False) -> int:
    """Progress-bar length: requests timed over the whole run."""
    n_server = (len(SERVER_ARMS) + (len(SERVER_FIXED_ARMS) if server_fixed else 0)
                + (len(SERVER_DRAFT_ARMS) if draft else 0))
    per = len(arms) + (n_server * len(concurrency) if server else 0)
    return sum(n_requests.values()) * per * repetitions


# ----------------------------------------------------------------- output
def format_table(report: Dict[str, Any]) -> str:
    """The report as a terminal table."""
    head = (
        f"mode: {report['mode']}  blas: {report['blas']}  model: {report['model']}"
        + (f"  servers: {report['ranks']} ranks" if report.get("ranks", 1) > 1 else "")
        + "\n"
        + (f"workloads: {describe_set(report['workload_set'])}\n" if report.get("workload_set") else "")
        + f"max_tokens {report['max_tokens']}, {report['repetitions']} paired repetition(s); "
        "speedup = median of per-repetition tok/s ratios to stock (end to end); "
        "decode = the same after the first token (prefill excluded)\n"
        "per request = median/p10/worst over requests of each request's tok/s ratio to stock's "
        "on the same request (median over repetitions); worst = the request of the worst decode ratio\n"
        + (f"draft model: {dm['model']}, scripted agreement {dm['agreement']}, stock drafts "
           f"{dm['stock_draft_tokens']} a round; model acc = its tokens accepted / drafted, "
           "agree = accepted / (accepted + drafts with a rejection)\n"
           if (dm := report.get("draft_model")) else "")
    )
    cols = (
        "workload", "arm", "speedup", "decode", "per request e2e", "per request decode", "worst",
        "tok/s", "accept", "model acc", "agree", "tok/step", "TTFT ms", "TPOT ms", "peak MB", "match",
    )
    rows = [cols]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def spread(m: Dict[str, Any], name: str) -> str:
        s = (m.get("per_request") or {}).get(name) or {}
        if s.get("median") is None:
            return "-"
        return "/".join(format(s[k], ".2f") for k in ("median", "p10", "worst"))

    for name, wl in report["workloads"].items():
        for arm, m in wl["arms"].items():
            pm = m.get("peak_memory_bytes")
            rows.append(
                (
                    name,
                    arm,
                    f(m.get("speedup_vs_stock"), ".2f") + ("x" if m.get("speedup_vs_stock") else ""),
                    f(m.get("decode_speedup_vs_stock"), ".2f")
                    + ("x" if m.get("decode_speedup_vs_stock") else ""),
                    spread(m, "end_to_end"),
                    spread(m, "decode"),
                    ((m.get("per_request") or {}).get("decode") or {}).get("worst_request") or "-",
                    f(m["tokens_per_s"], ".1f"),
                    f(m["acceptance_rate"], ".0%"),
                    f(m.get("model_acceptance"), ".0%"),
                    f(m.get("model_agreement"), ".0%"),
                    f(m["tokens_per_step"], ".2f"),
                    f(m["ttft_s"] * 1e3 if m["ttft_s"] is not None else None, ".0f"),
                    f(m["tpot_s"] * 1e3 if m["tpot_s"] is not None else None, ".1f"),
                    f(pm / 2**20 if pm else None, ".0f"),
                    {True: "yes", False: "NO", None: "-"}[m.get("matched_reference")],
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return head + "\n".join(lines + replay_lines(report) + prompt_cache_lines(report))


def describe_set(ws: Dict[str, Any]) -> str:
    """One line for a report's ``workload_set``: its ``set`` (``eval``,
    ``builtin`` or ``files``) and, for the evaluation set, its ``half``."""
    return ws["set"] + (f" ({ws['half']} half)" if ws.get("half") else "")


def replay_lines(report: Dict[str, Any]) -> List[str]:
    """A line per suffix arm: the cost curve its drafter learnt and its
    replays (in-process: with their estimated share of the time; a server:
    of batches and of single requests)."""

    def curve(cost: Optional[Dict[Any, float]]) -> str:
        if not cost:
            return "verify cost -"
        return "verify cost " + " ".join(f"{n}:{v:.2f}" for n, v in cost.items())

    lines = ["", "verify cost = a forward over n tokens / a plain step's (learnt by the drafter)"]
    for name, wl in report["workloads"].items():
        for arm, m in wl["arms"].items():
            stats = m.get("server_stats")
            if stats is not None:
                model = stats["models"][0] if stats.get("models") else {}
                batch = stats["batch"]
                lines.append(
                    f"{name} {arm}: {curve(model.get('verify_cost'))}; replays: batched "
                    f"{batch['replays']} ({batch['replayed_tokens']} tokens), single "
                    f"{model.get('replays', 0)} ({model.get('replayed_tokens', 0)} tokens)"
                )
            elif "verify_cost" in m:
                share = m.get("replay_share")
                est = "" if share is None else f", about {share:.1%} of the time (estimated)"
                lines.append(
                    f"{name} {arm}: {curve(m['verify_cost'])}; replays {m['replays']} "
                    f"({m['replayed_tokens']} tokens){est}"
                )
    return lines if len(lines) > 2 else []


def prompt_cache_lines(report: Dict[str, Any]) -> List[str]:
    """A line per server arm: the share of its prompt tokens the server's
    prompt cache held (``--prompt-cache-size`` bounds it alike on every
    server; a miss is prefilled whole)."""
    lines = []
    for name, wl in report["workloads"].items():
        for arm, m in wl["arms"].items():
            if m.get("prompt_tokens"):
                lines.append(
                    f"{name} {arm}: prompt cache held {m['cached_prompt_tokens'] / m['prompt_tokens']:.0%} "
                    f"of {m['prompt_tokens']:.0f} prompt tokens"
                )
    return ["", *lines] if lines else []


def plot(report: Dict[str, Any], path: str | os.PathLike) -> Optional[Path]:
    """Bar charts of speedup and acceptance per workload and arm (PNG);
    None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(report["workloads"])
    arms = [
        a
        for a in dict.fromkeys(a for wl in report["workloads"].values() for a in wl["arms"])
        if a != "stock" and not a.startswith("server-stock")
    ]
    fig, axes = plt.subplots(1, 3, figsize=(max(11, 3 * len(names) + 5), 4.2))
    width = 0.8 / max(1, len(arms))
    panels = (
        ("decode_speedup_vs_stock", axes[0], "decode speedup vs stock (x)"),
        ("speedup_vs_stock", axes[1], "end-to-end speedup vs stock (x)"),
        ("acceptance_rate", axes[2], "acceptance rate"),
    )
    for j, (key, ax, label) in enumerate(panels):
        for i, arm in enumerate(arms):
            vals = [report["workloads"][n]["arms"].get(arm, {}).get(key) or 0.0 for n in names]
            ax.bar([x + i * width for x in range(len(names))], vals, width, label=arm)
        ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(names))], names)
        ax.set_ylabel(label)
        if j < 2:
            ax.axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"mlx-lm-suffix bench ({report['mode']} mode, {report['blas']} BLAS)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
