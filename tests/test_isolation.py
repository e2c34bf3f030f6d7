"""One request's parameters never fail another's (issue 53): a normal
greedy request in flight on a ``--draft suffix`` server finishes with the
text it gives alone (a stock server's) while a neighbour whose sampling or
penalty parameters pass stock's validation but fail inside generation
arrives; the neighbour gets HTTP 400 naming the field; sampled requests
after it are served (an exception inside a compiled sampler leaves MLX's
global random key unusable: every later draw failed).

Stock mlx-lm 0.32.2 on the same neighbours: its generation thread dies,
failing the request in flight and every later one
(``test_stock_generation_thread_dies_on_a_failing_neighbour``).

Two layers: the handler checks what it can (``patches.validation``), and a
request whose sampler or logits processor raises anyway leaves the batch
with its own error (``patches.isolation``); ``tests/unchecked_server.py``
turns the first off to test the second.
"""

import http.client
import json
import sys
import threading
from pathlib import Path

import mlx_lm  # noqa: F401  (first: mlx_lm_suffix imports mlx_lm)
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_server import Server, _messages, _source_text  # noqa: E402

UNCHECKED_SERVER = Path(__file__).with_name("unchecked_server.py")
NAN = float("nan")
# The normal request: 1,000 greedy tokens without an EOS on the tiny model,
# undrafted (num_draft_tokens 0), so that it is still generating when the
# neighbour's answer comes back.
NORMAL_TEXT = _source_text(21, n=80)
NORMAL_TOKENS = 1000
VOCAB = 2048  # the tiny model's logits (checked in the vocab fixture)

# kind -> (the neighbour's fields, the field its 400 names). Each passes
# mlx-lm 0.32.2's validate_model_parameters and raises in its sampler
# (top_k, min_p, xtc, a huge int temperature) or logits processors (context
# sizes past MLX's 32-bit slice indices, huge int penalties).
FAILING = {
    "top_k = vocabulary": ({"temperature": 1.0, "top_k": VOCAB}, "top_k"),
    "top_k 10**12": ({"temperature": 0.7, "top_k": 10**12}, "top_k"),
    "xtc_threshold 0.9": (
        {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.9}, "xtc_threshold"),
    "xtc_threshold NaN": (
        {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": NAN}, "xtc_threshold"),
    "min_p NaN": ({"temperature": 1.0, "min_p": NAN}, "min_p"),
    "temperature 2**63": ({"temperature": 2**63}, "temperature"),
    "repetition_penalty 2**63": ({"repetition_penalty": 2**63}, "repetition_penalty"),
    "presence_penalty -2**64": ({"presence_penalty": -(2**64)}, "presence_penalty"),
    "frequency_penalty 2**64": ({"frequency_penalty": 2**64}, "frequency_penalty"),
    "repetition_context_size 2**32": (
        {"repetition_penalty": 1.1, "repetition_context_size": 2**32}, "repetition_context_size"),
    "presence_context_size 2**40": (
        {"presence_penalty": 0.5, "presence_context_size": 2**40}, "presence_context_size"),
    "frequency_context_size 2**64": (
        {"frequency_penalty": 0.5, "frequency_context_size": 2**64}, "frequency_context_size"),
}

# Values that look as bad but that stock serves (HTTP 200): answered as
# stock does, not refused. Greedy ones give stock's text.
STOCK_SERVES = {
    "top_k past the vocabulary, greedy": {"temperature": 0, "top_k": 10**12},
    "min_p NaN, greedy": {"temperature": 0, "min_p": NAN},
    "xtc_threshold 0.9, xtc off": {"temperature": 1.0, "xtc_probability": 0.0,
                                   "xtc_threshold": 0.9},
    "context size 2**40, penalty off": {"repetition_context_size": 2**40},
    "context size 2**31": {"repetition_penalty": 1.1, "repetition_context_size": 2**31},
    "temperature NaN": {"temperature": NAN},
    "temperature Infinity": {"temperature": float("inf")},
    "top_p NaN": {"temperature": 1.0, "top_p": NAN},
    "presence_penalty Infinity": {"presence_penalty": float("inf")},
    "repetition_penalty NaN": {"repetition_penalty": NAN},
    "penalty 2**63 - 1": {"frequency_penalty": 2**63 - 1},
    "logit_bias NaN and Infinity": {"logit_bias": {"5": NAN, "6": float("inf")}},
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("isolation-logs")


@pytest.fixture(scope="module")
def vocab(tiny_model_path):
    size = json.loads((Path(tiny_model_path) / "config.json").read_text())["vocab_size"]
    assert size == VOCAB
    return size


@pytest.fixture(scope="module")
def stock(tiny_model_path, logs):
    server = Server(tiny_model_path, log_dir=logs, name="stock")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def suffix(tiny_model_path, logs):
    server = Server(tiny_model_path, "--draft", "suffix", log_dir=logs, name="suffix")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unchecked(tiny_model_path, logs):
    """A suffix server whose handler checks nothing of issue 53's: the
    failing values reach generation."""
    server = Server(tiny_model_path, "--draft", "suffix", log_dir=logs, name="unchecked",
                    launcher=[sys.executable, str(UNCHECKED_SERVER)])
    yield server
    server.stop()


def _body(text, max_tokens, **extra):
    return {"messages": _messages(text), "max_tokens": max_tokens, **extra}


def post(server, body, stream=False):
    """POST a chat completion (NaN and big ints as Python's json writes
    them); returns (status, text, error): the error of a JSON reply or of
    a stream's error event."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(dict(body, stream=stream)),
                     {"Content-Type": "application/json"})
        try:
            r = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError) as e:
            return None, None, repr(e)  # closed without an answer
        if not stream or r.status != 200:
            reply = json.loads(r.read() or b"{}")
            if "error" in reply:
                return r.status, None, reply["error"]
            return r.status, reply["choices"][0]["message"]["content"], None
        text = ""
        for line in r:
            payload = line.strip()[len("data:"):].strip() if line.startswith(b"data:") else b""
            if not payload or payload == b"[DONE]":
                continue
            event = json.loads(payload)
            if "error" in event:
                return r.status, text, event["error"]
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
        return r.status, text, None
    finally:
        conn.close()


class InFlight:
    """The normal request, streamed in a thread: ``text`` and ``error``
    once joined, and ``after``: events that arrived after :meth:`mark`."""

    def __init__(self, server):
        self.started, self.marked = threading.Event(), threading.Event()
        self.text, self.error, self.after = "", None, 0
        self.thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the normal request did not start"

    def _run(self, server):
        body = _body(NORMAL_TEXT, NORMAL_TOKENS, temperature=0, num_draft_tokens=0, stream=True)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            for line in conn.getresponse():
                if not line.startswith(b"data:") or b"[DONE]" in line:
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    self.error = event["error"]
                    break
                for c in event["choices"]:
                    self.text += c["delta"].get("content") or ""
                self.after += self.marked.is_set()
                self.started.set()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)
        finally:
            conn.close()
            self.started.set()

    def mark(self):
        self.marked.set()

    def join(self):
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self.text, self.error


@pytest.fixture(scope="module")
def alone(stock):
    """The normal request's text alone (stock's)."""
    status, text, error = post(stock, _body(NORMAL_TEXT, NORMAL_TOKENS, temperature=0))
    assert status == 200, error
    return text


def sampled_ok(server):
    """A sampled request (temperature 1) is served: draws work."""
    status, text, error = post(server, _body("sample: one two", 8, temperature=1.0))
    return status == 200 and error is None


def neighbours_beside_normal(server, alone):
    """Every kind of :data:`FAILING` neighbour at once (every other one
    streamed) while the normal request is generating: asserts the normal
    request gave its text alone and was still in flight when the last
    neighbour's answer came; returns kind -> (streamed, status, error)."""
    normal = InFlight(server)
    results = {}

    def send(i, kind):
        stream = i % 2 == 1
        status, _, error = post(server, _body("hi there", 20, **FAILING[kind][0]), stream=stream)
        results[kind] = stream, status, error

    threads = [threading.Thread(target=send, args=(i, k)) for i, k in enumerate(FAILING)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    normal.mark()
    text, error = normal.join()
    assert error is None, error
    assert text == alone  # not cut, nor changed
    assert normal.after > 0, "the normal request finished before the neighbours' answers"
    assert len(results) == len(FAILING)
    return results


def test_failing_neighbours_get_400_and_harm_no_request(suffix, alone, vocab):
    for kind, (_, status, error) in neighbours_beside_normal(suffix, alone).items():
        field = FAILING[kind][1]
        assert status == 400 and field in error, (kind, status, error)
    assert sampled_ok(suffix)
    assert "generation loop failed" not in suffix.log()


@pytest.mark.parametrize("kind", list(STOCK_SERVES))
def test_values_stock_serves_are_served(kind, stock, suffix):
    fields = STOCK_SERVES[kind]
    body = _body(_source_text(3), 16, **fields)
    s_status, s_text, _ = post(stock, body)
    x_status, x_text, error = post(suffix, body)
    assert s_status == x_status == 200, error
    if fields.get("temperature", 0) == 0:
        assert x_text == s_text
    assert sampled_ok(suffix)


@pytest.mark.parametrize("value", [None, [1], 10**400], ids=["null", "list", "10**400"])
def test_logit_bias_values_stock_drops_get_400(value, stock, suffix):
    """Stock converts logit_bias values catching ValueError only: these
    raise another exception, which closes its connection unanswered."""
    body = _body("hi", 4, logit_bias={"5": value})
    assert post(stock, body)[0] is None
    status, _, error = post(suffix, body)
    assert status == 400 and error == "logit_bias must be a dict of int to float"
    assert post(suffix, _body("hi", 4))[0] == 200


def test_checked_for_a_model_loaded_later(suffix, tiny_model_path, tmp_path):
    """top_k needs the model's vocabulary: a request for a model not loaded
    yet is checked in the generation thread once it is (400 all the same)."""
    other = tmp_path / "other-model"
    import shutil

    shutil.copytree(tiny_model_path, other)
    body = _body("hi", 4, model=str(other), temperature=1.0, top_k=VOCAB)
    for _ in range(2):  # not loaded yet; then loaded (the handler checks)
        status, _, error = post(suffix, body)
        assert status == 400 and "top_k" in error, error
    assert sampled_ok(suffix)


def test_rows_that_fail_in_generation_leave_alone(unchecked, alone):
    """With the handler's checks off, each failing neighbour reaches its
    sampler or processors: it gets HTTP 400 (an error event once its stream
    has started) saying what failed; the normal request beside them is
    unharmed; draws still work after."""
    for kind, (stream, status, error) in neighbours_beside_normal(unchecked, alone).items():
        if stream:  # the failure comes once the stream has started: an error event
            assert status == 200 and error["code"] == 400, (kind, status, error)
            error = error["message"]
        else:
            assert status == 400, (kind, status, error)
        assert "parameters failed in generation" in error, (kind, error)
    assert sampled_ok(unchecked)
    assert unchecked.log().count("the request fails alone") == len(FAILING)
    assert "generation loop failed" not in unchecked.log()


def test_a_failing_single_request_leaves_alone(unchecked):
    """The same on the single-request path (a seed): 400, and the server
    serves the next seeded and sampled requests."""
    fields, _ = FAILING["top_k = vocabulary"]
    status, _, error = post(unchecked, _body("hi", 8, seed=3, **fields))
    assert status == 400 and "parameters failed in generation" in error
    status, _, error = post(unchecked, _body("hi", 8, seed=3, temperature=1.0))
    assert status == 200, error
    assert sampled_ok(unchecked)


def test_stock_generation_thread_dies_on_a_failing_neighbour(tiny_model_path, logs, alone):
    """What the suffix server's checks replace: stock drops the neighbour's
    connection, and answers the next request with "generation thread died"."""
    server = Server(tiny_model_path, log_dir=logs, name="stock-dies")
    try:
        fields, _ = FAILING["top_k = vocabulary"]
        status, _, error = post(server, _body("hi", 8, **fields))
        assert status is None, (status, error)  # the connection dropped
        status, _, error = post(server, _body("hi", 8, temperature=0))
        assert status == 404 and "generation thread died" in error
    finally:
        server.stop()
