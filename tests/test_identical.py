"""Requests a ``--draft suffix`` server answers exactly as stock does, field
for field, where drafting used to change the answer or stock breaks:
``logprobs``/``top_logprobs`` (not drafted), ``logit_bias`` ids outside the
vocabulary (HTTP 400 where stock crashes), ``stream_options`` without
``include_usage`` (streams to ``[DONE]``). Each test compares with a stock
server on the same tiny float32 model, and the server keeps serving.

Both servers run with OpenBLAS where it is installed (Linux): a forward over
8+ tokens then gives logits a few ulps off one-token steps, as a GPU does,
which the reference BLAS of the ``mlx-cpu`` wheel does not show.
"""

import inspect
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import mlx_lm  # (first: mlx_lm_suffix imports mlx_lm)
import pytest

from mlx_lm_suffix.tools.bench import OPENBLAS

sys.path.insert(0, str(Path(__file__).parent))
from test_server import SUFFIX_FIXED, Server, _messages, _source_text  # noqa: E402

MAX_TOKENS = 32


def blas_env() -> Dict[str, str]:
    """OpenBLAS for the servers where it is installed (one thread: the same
    kernels on every run)."""
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        return {"LD_PRELOAD": OPENBLAS, "OPENBLAS_NUM_THREADS": "1"}
    return {}


def quantized_width(model_path: Path, bits: int) -> int:
    """:func:`~mlx_lm_suffix.loop.quantized_width` for the model at
    ``model_path``, computed in a process with the servers' environment."""
    code = ("import sys, mlx_lm; from mlx_lm_suffix import loop; "
            "m, _ = mlx_lm.load(sys.argv[1]); "
            "print(loop.quantized_width(m, int(sys.argv[2]), 32, 9))")
    out = subprocess.run([sys.executable, "-c", code, str(model_path), str(bits)],
                         env={**os.environ, **blas_env()}, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("identical-logs")


@pytest.fixture(scope="module")
def stock(tiny_model_path, logs):
    server = Server(tiny_model_path, log_dir=logs, name="stock", env=blas_env())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def suffix(tiny_model_path, logs):
    # Fixed-length drafting: every repeat is verified, whatever the timings.
    server = Server(tiny_model_path, *SUFFIX_FIXED, log_dir=logs, name="suffix", env=blas_env())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vocab(tiny_model_path) -> int:
    """The tiny model's vocabulary: the length of its logits."""
    return json.loads((Path(tiny_model_path) / "config.json").read_text())["vocab_size"]


def chat(server: Server, text: str, **extra: Any) -> Dict[str, Any]:
    """A greedy chat completion's JSON (asserts HTTP 200)."""
    body = {"messages": _messages(text), "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    status, reply = server.post("/v1/chat/completions", body)
    assert status == 200, reply
    return reply


def answer(reply: Dict[str, Any]):
    choice = reply["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def events(server: Server, text: str, **extra: Any) -> List[str]:
    """The ``data:`` payloads of a streamed greedy chat completion, as sent,
    until the server closes the stream."""
    body = {"messages": _messages(text), "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, **extra}
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    return [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]


def streamed_text(payloads: List[str]):
    """(text, finish_reason, usage) of a stream's payloads (``[DONE]`` aside)."""
    text, finish, usage = "", None, None
    for p in payloads:
        if p == "[DONE]":
            continue
        chunk = json.loads(p)
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text += c["delta"].get("content") or ""
            finish = c["finish_reason"] or finish
    return text, finish, usage


PROBE = "probe: " + "alpha beta gamma " * 3


# -------------------------------------------------------------- logprobs
def test_logprobs_equal_stock(stock, suffix):
    """10 requests for ``logprobs`` with ``top_logprobs`` 1, 5 and 10, each
    text twice (the second repeats the first answer, which the trees
    hold): the whole ``logprobs`` object equals stock's (ids, order, tokens,
    values), and nothing was drafted. One goes through the single-request
    path (``seed``). The same text without logprobs is drafted."""
    texts = [_source_text(60 + i) for i in range(5)]
    differ, drafted = [], []
    for i, text in enumerate(texts * 2):
        extra = {"logprobs": True, "top_logprobs": (1, 5, 10)[i % 3]}
        if i == 7:
            extra["seed"] = 7  # stock and suffix: _serve_single
        ref, got = chat(stock, text, **extra), chat(suffix, text, **extra)
        assert answer(got) == answer(ref)
        if got["choices"][0]["logprobs"] != ref["choices"][0]["logprobs"]:
            differ.append(i)
        if got["usage"]["draft_tokens"] or got["usage"]["accepted_draft_tokens"]:
            drafted.append(i)
    assert differ == [] and drafted == []
    # logprobs alone (no top_logprobs), too.
    ref, got = chat(stock, texts[0], logprobs=True), chat(suffix, texts[0], logprobs=True)
    assert got["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]
    assert got["usage"]["draft_tokens"] == 0
    # Without logprobs the same request drafts (its answer is cached).
    plain = chat(suffix, texts[0])
    assert answer(plain) == answer(ref)
    assert plain["usage"]["accepted_draft_tokens"] > 0
    assert suffix.wait_idle()["active_requests"] == 0


# ------------------------------------------------------------ logit_bias
def test_logit_bias_outside_the_vocabulary_gets_400(stock, suffix, vocab):
    """A ``logit_bias`` key that indexes no token of the model's logits (at
    or past their length, or before minus it) gets HTTP 400 naming it;
    stock crashes (SIGSEGV) on the first. The largest id works as on stock,
    so do negative ids counted from the end (stock's indexing takes them
    so), and the server keeps serving stock's answers."""
    probe = answer(chat(stock, PROBE))
    for key in (-1, -vocab):
        bias = {"logit_bias": {str(key): 100}}
        assert answer(chat(suffix, PROBE, **bias)) == answer(chat(stock, PROBE, **bias))
    for key in (vocab, vocab + 1000, -vocab - 1, 2**40):
        body = {"messages": _messages(PROBE), "max_tokens": 4, "logit_bias": {str(key): 5}}
        status, reply = suffix.post("/v1/chat/completions", body)
        assert status == 400, (key, reply)
        assert "logit_bias" in reply["error"] and str(key) in reply["error"]
        assert f"0 to {vocab - 1}" in reply["error"]
        assert answer(chat(suffix, PROBE)) == probe
    last = {"logit_bias": {str(vocab - 1): 100}}
    assert answer(chat(suffix, PROBE, **last)) == answer(chat(stock, PROBE, **last))
    assert suffix.wait_idle()["active_requests"] == 0


def test_logit_bias_checked_for_a_model_loaded_later(stock, suffix, tiny_model_path, vocab,
                                                     tmp_path):
    """A request for a model the server has not loaded yet (the handler does
    not know its vocabulary) is checked in the generation thread once that
    model is loaded: HTTP 400 all the same. Then the default model serves
    stock's answer."""
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_path, other)
    body = {"model": str(other), "messages": _messages(PROBE), "max_tokens": 4,
            "logit_bias": {str(vocab): 5}}
    loaded = lambda: any(m["model"] == other.name for m in suffix.stats()["models"])  # noqa: E731
    assert not loaded()
    for _ in range(2):  # not loaded yet; then loaded (the handler checks)
        status, reply = suffix.post("/v1/chat/completions", body)
        assert status == 400, reply
        assert f"logit_bias key {vocab} is not a token id" in reply["error"]
    assert loaded()
    assert answer(chat(suffix, PROBE)) == answer(chat(stock, PROBE))


# -------------------------------------------------------- stream_options
@pytest.mark.parametrize("options", [{}, {"other": 1}, {"include_usage": True}],
                         ids=["empty", "no-include_usage", "include_usage"])
def test_stream_options_stream_to_done(stock, suffix, options):
    """``stream_options`` without ``include_usage`` streams as with it false:
    stock's text, no error event, ``[DONE]`` last (stock ends such a stream
    without it). With it true, the usage chunk comes before ``[DONE]``."""
    text = _source_text(70)
    ref = streamed_text(events(stock, text, stream_options={"include_usage": False}))
    for _ in range(2):  # the second drafts from the first
        got = events(suffix, text, stream_options=options)
        assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
        text_, finish, usage = streamed_text(got)
        assert (text_, finish) == ref[:2]
        assert (usage is not None) == bool(options.get("include_usage"))
    assert answer(chat(suffix, PROBE)) == answer(chat(stock, PROBE))


# ------------------------------------------------------ quantized KV cache
# ------------------------------------------------------------------ seed
def test_a_seed_reproduces_stocks_answer(stock, suffix):
    """A sampled request with a seed, sent three times to the suffix server
    (served one at a time, drafts verified: the text repeats), gives stock's
    answer for that seed every time."""
    text = "Repeat this exactly, three times: " + _source_text(7, 120)
    kw = dict(temperature=0.8, seed=42, max_tokens=48)
    want = answer(chat(stock, text, **kw))
    drafted = 0
    for _ in range(3):
        reply = chat(suffix, text, **kw)
        assert answer(reply) == want
        drafted += reply["usage"]["draft_tokens"]
    assert drafted > 0


# ----------------------------------------------------- quantized KV cache
def _kv_prompts(tokenizer) -> List[List[int]]:
    """20 prompts whose answers the next request repeats: 19 short ones and
    one of over 5,000 tokens (past mlx-lm's default quantized_kv_start)."""
    prompts = [tokenizer.encode(_source_text(70 + i, 400)) for i in range(19)]
    long = tokenizer.encode(inspect.getsource(inspect)[:20000])
    assert len(long) > 5000
    return prompts + [long]


@pytest.fixture(scope="module")
def mini(models_dir):
    """The mini model (its heads of 32 quantize in groups of 32; the tiny
    model's of 16 do not, on stock either) and the KV prompts."""
    from mlx_lm_suffix.tools.models import ensure_model

    model, tokenizer = mlx_lm.load(str(ensure_model("qwen3", "mini", cache_dir=models_dir)))
    return model, tokenizer, _kv_prompts(tokenizer)


@pytest.mark.parametrize("bits,start", [(4, 0), (8, 0), (4, None), (8, None)])
def test_quantized_kv_cache_greedy_equals_stock(mini, bits, start):
    """kv_bits 4 and 8, quantized_kv_start 0 and mlx-lm's default: greedy
    tokens and logprobs equal stock's on 19 short prompts, and with 8 bits
    and the default start one of over 5,000 tokens too (its prefill takes
    seconds with this process's reference BLAS; the servers' test sends it
    in every setting), each generated twice so the second drafts the first
    answer (verified where forwards quantize as one-token steps do, and
    never across the conversion point)."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    from mlx_lm_suffix import SuffixDrafter

    model, tokenizer, prompts = mini
    if (bits, start) != (8, None):
        prompts = prompts[:-1]
    kw = dict(max_tokens=24, kv_bits=bits, kv_group_size=32,
              quantized_kv_start=DEFAULT_QUANTIZED_KV_START if start is None else start)

    def run(prompt, **extra):
        out = list(mlx_lm.stream_generate(model, tokenizer, prompt, **kw, **extra))
        return [r.token for r in out], mx.stack([r.logprobs for r in out])

    drafter = SuffixDrafter(policy="fixed")
    for prompt in prompts:
        ref_tokens, ref_logprobs = run(prompt)
        for _ in range(2):
            tokens, logprobs = run(prompt, draft_model=drafter)
            assert tokens == ref_tokens
            assert mx.allclose(logprobs, ref_logprobs, atol=1e-4).item()
    assert drafter.snapshot()["accepted"] > 100  # repeats were drafted


@pytest.mark.parametrize("start", [0, 20])
def test_quantized_kv_cache_with_a_draft_model_equals_stock(mini, start):
    """kv_bits 8 with a draft model (the model itself, every third draft
    token made wrong), its cache quantized from the start or after 20
    tokens: stock's greedy tokens; the draft model keeps its drafted
    positions there too (the quantized cache trims), and after each
    generation it holds the prompt and the tokens, as the target does."""
    from mlx_lm.generate import generate_step
    from test_draft_model import _every, _with_draft

    from mlx_lm_suffix.loop import suffix_generate_step

    model, tokenizer, prompts = mini
    kw = dict(max_tokens=32, kv_bits=8, kv_group_size=32, quantized_kv_start=start)
    for prompt in prompts[:4]:
        ref = [t for t, _ in generate_step(mx.array(prompt), model, **kw)]
        drafter = _with_draft(model, model, _every(3))
        paired = drafter.draft_model.pair(model)
        cache = paired.make_cache()
        assert paired.follows_lazily(cache)
        out = [t for t, _, _ in suffix_generate_step(mx.array(prompt), model, drafter,
                                                     prompt_cache=cache, **kw)]
        assert out == ref
        assert drafter.stats.source_accepted.get("model", 0) > 0
        assert type(cache[0]).__name__ == "QuantizedKVCache"
        assert cache[-1].caches[0].offset == cache[0].offset


@pytest.mark.parametrize("bits,start", [(8, 0), (4, None)])
def test_quantized_kv_cache_through_the_server(mini, models_dir, logs, bits, start):
    """The same through servers with OpenBLAS (where a wide forward
    quantizes keys and values other than one-token steps do, so the suffix
    server verifies only narrow forwards, or none once the cache is
    quantized): every answer stock's; the repeats drafted where the cache
    starts unquantized or takes forwards wider than one token with these
    kernels (:func:`~mlx_lm_suffix.loop.quantized_width`, asked with the
    servers' environment), else nothing drafted."""
    from mlx_lm_suffix.tools.models import ensure_model

    model_path = ensure_model("qwen3", "mini", cache_dir=models_dir)
    flags = ["--kv-bits", str(bits), "--kv-group-size", "32"]
    if start is not None:
        flags += ["--quantized-kv-start", str(start)]
    tokenizer = mini[1]
    texts = [tokenizer.decode(p) for p in mini[2][::4] + mini[2][-1:]]
    servers = [Server(model_path, *flags, *extra, log_dir=logs, name=f"kv{bits}-{name}",
                      env=blas_env())
               for name, extra in (("stock", ()), ("suffix", SUFFIX_FIXED))]
    try:
        drafted = 0
        for text in texts:
            ref = answer(chat(servers[0], text))
            for _ in range(2):
                reply = chat(servers[1], text)
                assert answer(reply) == ref
                drafted += reply["usage"]["accepted_draft_tokens"]
        if start is None or quantized_width(model_path, bits) > 1:
            assert drafted > 0
        else:
            assert drafted == 0
    finally:
        for server in servers:
            server.stop()
