"""``mlx_lm.server --draft suffix`` on model families whose caches do not all
trim, served in batches: ``qwen3_5`` (GatedDeltaNet recurrent state,
``ArraysCache``, next to attention) and ``gpt_oss`` (sliding windows,
``RotatingKVCache``). Their tiny float32 models are built by
``mlx_lm_suffix.tools.models`` and served from one saved folder by a stock
server and a suffix server.

Eight concurrent greedy requests (chat and text, prompts of different
lengths, some repetitive, different ``max_tokens``) join one batch behind a
long streamed "blocker" request; the same eight are sent again (warm: they
draft from their first responses in the global cache). Every response's
token ids must equal the stock server's, with their logprobs.

Both families' batches draft: ``qwen3_5`` restores its recurrent state and
replays each row's kept tokens; ``gpt_oss`` (``BatchRotatingKVCache`` next to
``BatchKVCache``) trims each row, also once its window has wrapped. Their
single requests draft too.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import mlx_lm  # noqa: F401  (first: mlx_lm_suffix imports mlx_lm)
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_server import SUFFIX_FIXED, Server, _messages, _source_text  # noqa: E402

#: The eight requests: (endpoint, prompt, max_tokens).
REQUESTS: List[Tuple[str, str, int]] = [
    ("chat", _source_text(0, n=120), 24),
    ("text", "Repeat after me: " + "one two three four " * 6, 40),
    ("chat", _source_text(1, n=240), 32),
    ("text", _source_text(2, n=60), 16),
    ("chat", "alpha beta gamma delta " * 10, 48),
    ("text", _source_text(3, n=320), 20),
    ("chat", "x = 1\ny = 2\n" * 8, 36),
    ("text", _source_text(4, n=90), 28),
]
BLOCKER_TOKENS = 2000
# Logprobs of a batched verification forward and of stock's one-token
# steps, in float32: equal up to rounding.
LOGPROB_ATOL = 1e-4


@dataclass
class Output:
    """What one greedy response generated."""

    text: str
    finish_reason: str
    ids: List[int]
    logprobs: List[float]
    usage: Dict[str, Any]


@dataclass
class Servers:
    """A stock and a ``--draft suffix`` server on one family's model."""

    family: str
    stock: Server
    suffix: Server


@pytest.fixture(scope="module", params=["qwen3_5", "gpt_oss"])
def servers(request, tiny_family_path, tmp_path_factory) -> Iterator[Servers]:
    family = request.param
    path = tiny_family_path(family)
    logs = tmp_path_factory.mktemp(f"{family}-server-logs")
    # Both load at once (each readiness wait is bounded).
    stock = Server(path, log_dir=logs, name="stock", wait=False)
    suffix = Server(path, *SUFFIX_FIXED, log_dir=logs, name="suffix", wait=False)
    try:
        stock.wait_ready(120)
        suffix.wait_ready(120)
        yield Servers(family, stock, suffix)
    finally:
        suffix.stop()
        stock.stop()


def _body(kind: str, prompt: str, max_tokens: int, **extra: Any) -> Tuple[str, Dict[str, Any]]:
    """The endpoint and body of a greedy request with logprobs."""
    body: Dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        **extra,
    }
    if kind == "chat":
        return "/v1/chat/completions", {"messages": _messages(prompt), **body}
    return "/v1/completions", {"prompt": prompt, **body}


def _send(server: Server, kind: str, prompt: str, max_tokens: int, **extra: Any) -> Output:
    path, body = _body(kind, prompt, max_tokens, **extra)
    status, reply = server.post(path, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    content = choice.get("logprobs", {}).get("content", [])
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return Output(
        text,
        choice["finish_reason"],
        [t["id"] for t in content],
        [t["logprob"] for t in content],
        reply["usage"],
    )


def _concurrently(server: Server, blocker_extra: Dict[str, Any]) -> List[Output]:
    """The eight requests at once, while a long streamed request keeps the
    batch busy (so that they queue up and join it together)."""
    client = server.client()
    blocker = client.chat.completions.create(
        model="default_model",
        messages=_messages("blocker " + _source_text(30)),
        max_tokens=BLOCKER_TOKENS,
        temperature=0,
        stream=True,
        extra_body=blocker_extra,
    )
    try:
        next(iter(blocker))
        barrier = threading.Barrier(len(REQUESTS), timeout=60)

        def one(spec: Tuple[str, str, int]) -> Output:
            barrier.wait()
            return _send(server, *spec)

        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            return list(pool.map(one, REQUESTS))
    finally:
        blocker.close()  # client disconnect


def _assert_equal(got: List[Output], ref: List[Output], what: str) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        where = f"{what}, request {i}"
        assert g.ids == r.ids, where
        assert (g.text, g.finish_reason) == (r.text, r.finish_reason), where
        assert g.logprobs == pytest.approx(r.logprobs, abs=LOGPROB_ATOL), where


@pytest.fixture(scope="module")
def passes(servers: Servers) -> Dict[str, Any]:
    """Both servers' outputs of a cold and a warm pass, and the suffix
    server's stats before and after."""
    stock_blocker: Dict[str, Any] = {}
    suffix_blocker = {"num_draft_tokens": 0}  # (its row stays in the verifications)
    ref = [_concurrently(servers.stock, stock_blocker) for _ in range(2)]
    before = servers.suffix.stats()
    cold = _concurrently(servers.suffix, suffix_blocker)
    warm = _concurrently(servers.suffix, suffix_blocker)
    after = servers.suffix.wait_idle()
    return {"ref": ref, "cold": cold, "warm": warm, "before": before, "after": after}


def test_batched_outputs_equal_stock(servers: Servers, passes: Dict[str, Any]) -> None:
    """Cold and warm (the servers' prompt caches reused, the suffix server
    drafting from its cache), every request's tokens and logprobs equal the
    stock server's in the same pass, and stock's own passes agree."""
    ref_cold, ref_warm = passes["ref"]
    _assert_equal(passes["cold"], ref_cold, "suffix cold vs stock cold")
    _assert_equal(passes["warm"], ref_warm, "suffix warm vs stock warm")
    _assert_equal(ref_warm, ref_cold, "stock warm vs stock cold")
    for o in passes["ref"][0]:
        assert len(o.ids) == o.usage["completion_tokens"]


def _batch_delta(passes: Dict[str, Any]) -> Dict[str, int]:
    before, after = passes["before"]["batch"], passes["after"]["batch"]
    return {k: after[k] - before[k] for k in ("verify_steps", "replays", "verify_rows")} | {
        "max_verify_batch_size": after["max_verify_batch_size"]
    }


def test_batch_drafting(servers: Servers, passes: Dict[str, Any]) -> None:
    """The batches verified drafts (several rows at once) and the warm pass
    accepted drafts in every row; qwen3_5 restored and replayed its
    recurrent state, gpt_oss's sliding windows trimmed (no replays). No
    load-time warning that batches do not draft."""
    delta = _batch_delta(passes)
    warm = [o.usage["accepted_draft_tokens"] for o in passes["warm"]]
    cold = [o.usage["accepted_draft_tokens"] for o in passes["cold"]]
    after = passes["after"]
    assert after["active_requests"] == 0
    assert delta["verify_steps"] > 0 and delta["max_verify_batch_size"] >= 2, delta
    if servers.family == "qwen3_5":
        assert delta["replays"] > 0, delta
    else:
        assert delta["replays"] == 0, delta
    assert sum(warm) > sum(cold) >= 0
    # Every row drafts from its own cold response (the global cache).
    assert all(a > 0 for a in warm), warm
    assert servers.suffix.log().count("concurrent (batched) requests are served without") == 0


def test_single_requests_draft_and_serving_goes_on(
    servers: Servers, passes: Dict[str, Any]
) -> None:
    """After the batches, the suffix server still serves: a request with a
    ``seed`` (not batchable: the single-request path) drafts for both
    families, the warm one from its first response, with stock's tokens."""
    kind, prompt, max_tokens = "chat", "seeded " + _source_text(6, n=150), 32
    ref = _send(servers.stock, kind, prompt, max_tokens, seed=7)
    first = _send(servers.suffix, kind, prompt, max_tokens, seed=7)
    second = _send(servers.suffix, kind, prompt, max_tokens, seed=7)
    _assert_equal([first, second], [ref, ref], "single cold, warm")
    assert second.usage["accepted_draft_tokens"] > first.usage["accepted_draft_tokens"]
    assert servers.suffix.wait_idle()["active_requests"] == 0
