"""``mlx_lm.server --draft suffix`` on every model family whose caches do not
all trim, served in batches: sliding windows (``RotatingKVCache``: gpt_oss,
gemma3_text), recurrent state next to attention (``ArraysCache``: qwen3_5,
qwen3_next, lfm2, nemotron_h; mamba2 has no attention) and both in one layer
(``CacheList``: falcon_h1). Their tiny float32 models are built by
``mlx_lm_suffix.tools.models`` and served from one saved folder by a stock
server and a suffix server.

Concurrent greedy requests (chat and text, prompts of different lengths,
longer than the windows, some repetitive, different ``max_tokens``) join one
batch behind a long streamed "blocker" request; the same are sent again
(warm: they draft from their first responses in the global cache). Every
response's token ids must equal the stock server's, with their logprobs.
qwen3_5 and gpt_oss get eight requests; the other families, whose caches
roll back the same ways, four shorter ones (to keep the suite's time).

Every family's batches draft: recurrent state is restored and each row's
kept tokens replayed; sliding windows (``BatchRotatingKVCache`` next to
``BatchKVCache``) trim each row, also once wrapped. Single requests draft
too, replaying where the state is recurrent.

The requests ask for logprobs (their token ids), which a suffix server
serves without drafting: the suffix servers here run
``tests/logprobs_drafting_server.py``, which drafts them.
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

# A suffix server that drafts requests for logprobs (see its doc).
LOGPROBS_DRAFTING = [sys.executable, str(Path(__file__).with_name("logprobs_drafting_server.py"))]

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
#: Four of them, shorter: for the families past the first two.
SHORT_REQUESTS: List[Tuple[str, str, int]] = [
    ("chat", _source_text(0, n=120), 16),
    ("text", "Repeat after me: " + "one two three four " * 6, 24),
    ("text", _source_text(3, n=320), 12),
    ("chat", "x = 1\ny = 2\n" * 8, 20),
]
#: Family -> whether its caches hold recurrent state (a rejection then
#: restores it and replays the kept tokens) rather than sliding windows.
FAMILIES: Dict[str, bool] = {
    "qwen3_5": True,
    "gpt_oss": False,
    "gemma3_text": False,
    "qwen3_next": True,
    "lfm2": True,
    "nemotron_h": True,
    "mamba2": True,
    "falcon_h1": True,
}
BLOCKER_TOKENS = 2000
# Logprobs of a batched verification forward and of stock's one-token
# steps, in float32: equal up to rounding, the tolerance test_families uses
# for logits (a recurrent layer's multi-token scan sums in another order than
# its one-token step: falcon_h1 differed by 4.8e-4 at a logprob of -4.93).
LOGPROB_ATOL, LOGPROB_RTOL = 1e-4, 1e-3


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
    requests: List[Tuple[str, str, int]]

    @property
    def recurrent(self) -> bool:
        return FAMILIES[self.family]


@pytest.fixture(scope="module", params=list(FAMILIES))
def servers(request, tiny_family_path, tmp_path_factory) -> Iterator[Servers]:
    family = request.param
    requests = REQUESTS if family in ("qwen3_5", "gpt_oss") else SHORT_REQUESTS
    path = tiny_family_path(family)
    logs = tmp_path_factory.mktemp(f"{family}-server-logs")
    # Both load at once (each readiness wait is bounded).
    stock = Server(path, log_dir=logs, name="stock", wait=False)
    suffix = Server(path, *SUFFIX_FIXED, log_dir=logs, name="suffix", wait=False,
                    launcher=LOGPROBS_DRAFTING)
    try:
        stock.wait_ready(120)
        suffix.wait_ready(120)
        yield Servers(family, stock, suffix, requests)
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


def _concurrently(
    server: Server, requests: List[Tuple[str, str, int]], blocker_extra: Dict[str, Any]
) -> List[Output]:
    """``requests`` at once, while a long streamed request keeps the
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
        barrier = threading.Barrier(len(requests), timeout=60)

        def one(spec: Tuple[str, str, int]) -> Output:
            barrier.wait()
            return _send(server, *spec)

        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, requests))
    finally:
        blocker.close()  # client disconnect


def _assert_equal(got: List[Output], ref: List[Output], what: str) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        where = f"{what}, request {i}"
        assert g.ids == r.ids, where
        assert (g.text, g.finish_reason) == (r.text, r.finish_reason), where
        assert g.logprobs == pytest.approx(
            r.logprobs, abs=LOGPROB_ATOL, rel=LOGPROB_RTOL
        ), where


@pytest.fixture(scope="module")
def passes(servers: Servers) -> Dict[str, Any]:
    """Both servers' outputs of a cold and a warm pass, and the suffix
    server's stats before and after."""
    stock_blocker: Dict[str, Any] = {}
    suffix_blocker = {"num_draft_tokens": 0}  # (its row stays in the verifications)
    reqs = servers.requests
    ref = [_concurrently(servers.stock, reqs, stock_blocker) for _ in range(2)]
    before = servers.suffix.stats()
    cold = _concurrently(servers.suffix, reqs, suffix_blocker)
    warm = _concurrently(servers.suffix, reqs, suffix_blocker)
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
    keys = ("verify_steps", "replays", "replayed_tokens", "verify_rows")
    return {k: after[k] - before[k] for k in keys} | {
        "max_verify_batch_size": after["max_verify_batch_size"]
    }


def test_batch_drafting(servers: Servers, passes: Dict[str, Any]) -> None:
    """The batches verified drafts (several rows at once) and the warm pass
    accepted drafts in every row; recurrent state was restored and replayed
    (each replay feeds each row at least one token), sliding windows
    trimmed (no replays). No load-time warning that batches do not draft."""
    delta = _batch_delta(passes)
    warm = [o.usage["accepted_draft_tokens"] for o in passes["warm"]]
    cold = [o.usage["accepted_draft_tokens"] for o in passes["cold"]]
    after = passes["after"]
    assert after["active_requests"] == 0
    assert delta["verify_steps"] > 0 and delta["max_verify_batch_size"] >= 2, delta
    if servers.recurrent:
        assert delta["replays"] > 0 and delta["replayed_tokens"] >= delta["replays"], delta
    else:
        assert delta["replays"] == delta["replayed_tokens"] == 0, delta
    assert sum(warm) > sum(cold) >= 0
    # Every row drafts from its own cold response (the global cache).
    assert all(a > 0 for a in warm), warm
    assert servers.suffix.log().count("concurrent (batched) requests are served without") == 0


def test_single_requests_draft_and_serving_goes_on(
    servers: Servers, passes: Dict[str, Any]
) -> None:
    """After the batches, the suffix server still serves: a request with a
    ``seed`` (not batchable: the single-request path) drafts for every
    family, the warm one from its first response, with stock's tokens, and
    their replays (recurrent state, or a wrapped window) are counted."""
    kind, prompt, max_tokens = "chat", "seeded " + _source_text(6, n=150), 32
    ref = _send(servers.stock, kind, prompt, max_tokens, seed=7)
    before = servers.suffix.stats()["models"][0]
    first = _send(servers.suffix, kind, prompt, max_tokens, seed=7)
    second = _send(servers.suffix, kind, prompt, max_tokens, seed=7)
    _assert_equal([first, second], [ref, ref], "single cold, warm")
    assert second.usage["accepted_draft_tokens"] > first.usage["accepted_draft_tokens"]
    after = servers.suffix.wait_idle()
    assert after["active_requests"] == 0
    model = after["models"][0]
    rejected = model["drafted"] - model["accepted"] - (before["drafted"] - before["accepted"])
    replays = model["replays"] - before["replays"]
    replayed = model["replayed_tokens"] - before["replayed_tokens"]
    # A replay follows a verification that rejected some of its draft (a
    # draft whose first token a plain step rejected is not verified).
    assert replays <= rejected and replayed >= replays, (rejected, replays, replayed)
