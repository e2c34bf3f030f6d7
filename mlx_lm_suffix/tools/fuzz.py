"""Differential fuzzing of ``mlx_lm.server --draft suffix`` against stock
(``mlx-lm-suffix soak --fuzz``).

``hypothesis`` generates requests for ``/v1/chat/completions`` and
``/v1/completions``: every body field mlx-lm 0.32.2's server reads (and the
plugin's), with valid values, invalid values and wrong types, nested,
huge and unicode ones, fields missing and extra, streamed or not; and junk:
bodies that are not JSON or not UTF-8, JSON that is not an object or nests
deeper than the parser goes, wrong or missing Content-Length and
Content-Type, extra headers. Each goes to a stock server (mlx-lm not
patched at all) and to a ``--draft suffix`` server on the same model, one
after the other, with a greedy witness request sent to the suffix server
beside each (``draft_model``: the suffix server pairs it, ``--draft suffix
--draft-model D``, and every check holds against the same stock server,
which has none; ``policy``: the suffix server's ``--suffix-policy``).
Checked:

- the suffix server answers every request (never drops a connection, never
  hangs, never a 5xx, never a stream that ends without ``[DONE]`` or a
  4xx error event) and stays up;
- where stock answers, the suffix server's status class is stock's; where
  stock fails (drops the connection, 5xx, a broken stream, its generation
  thread or process dies, a hang), a clear 4xx (a JSON ``error``) or a
  complete answer;
- where stock answers 200 to a greedy request, the same text and finish
  reason (a stream cut by the client after some events: the same events);
- the witness always gets stock's text: no request harms another;
- the suffix server's memory stays bounded (RSS, with psutil).

Differences that are intended are listed in :data:`INTENDED` and counted
apart. Stock is restarted whenever it died (or its generation thread did).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .launcher import HOST
from .soak import RSS_SLACK_MB, TREE_BYTES_PER_TOKEN, SoakServer, counts_by_source, suffix_args

__all__ = ["run_fuzz", "Case", "Answer", "compare", "json_case"]

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
#: Both servers' --max-tokens (a request without max_tokens generates this many).
SERVER_MAX_TOKENS = 24
#: Events a client reads of a stream whose max_tokens is past this before it closes.
CUT_EVENTS = 40
#: Seconds a request may take before it counts as hung.
TIMEOUT_S = 60.0
#: The suffix server's cache bounds (--suffix-max-cached-requests, -tokens).
CACHED_REQUESTS, CACHED_TOKENS = 50, 20000
#: RSS growth after the warm-up (the first fifth of the run) allowed to the
#: suffix server: as :mod:`mlx_lm_suffix.tools.soak` allows (allocator and
#: MLX buffer-cache noise, 1 KiB per cached token of the trees).
RSS_LIMIT_MB = RSS_SLACK_MB + CACHED_TOKENS * TREE_BYTES_PER_TOKEN / 2**20
#: Where a suffix server answers otherwise than stock on purpose: whether
#: a case's JSON body and the two answers (stock's, the suffix server's)
#: are such a difference, and why.
INTENDED: Dict[str, Tuple[Callable[[Dict[str, Any], "Answer", "Answer"], bool], str]] = {
    "num_draft_tokens a bool": (
        lambda b, stock, suffix: isinstance(b.get("num_draft_tokens"), bool)
        and suffix.clear_4xx and "num_draft_tokens" in str(suffix.error),
        "400 naming the field: an integer is asked for (stock takes true as 1)",
    ),
    "draft_model suffix": (
        lambda b, stock, suffix: b.get("draft_model") == "suffix" and stock.status == 404
        and suffix.kind in ("ok", "cut"),
        "served, drafting (stock tries to load a model called 'suffix': 404)",
    ),
}


# --------------------------------------------------------------- requests
@dataclass
class Case:
    """One request: what goes on the wire, and what it means."""

    path: str
    headers: List[Tuple[str, str]]
    body: bytes
    fields: Optional[Dict[str, Any]] = None  # the JSON object sent, where it is one
    stream: bool = False  # read as a stream
    cut: Optional[int] = None  # events read before the client closes
    shape: str = ""

    def greedy(self) -> bool:
        """Whether it samples greedily (no temperature: the servers' default, 0)."""
        return (self.fields or {}).get("temperature", 0) == 0


def _type(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return repr(v).lower()
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, int) and not -(2**31) <= v < 2**31:
        return "bigint"
    return type(v).__name__


def shape_of(path: str, body: Any, stream: bool, junk: str = "") -> str:
    """A request's shape: the endpoint, and each top-level field with its
    value's type (for messages, each message's role and content types)."""
    if junk:
        return f"{path} junk:{junk}"
    if not isinstance(body, dict):
        return f"{path} {_type(body)}"
    parts = []
    for k in sorted(body):
        v = body[k]
        if k == "messages" and isinstance(v, list):
            inner = ",".join(sorted({f"{_type(m.get('role')) if isinstance(m, dict) else '-'}:"
                                     f"{_type(m.get('content')) if isinstance(m, dict) else _type(m)}"
                                     for m in v}))
            parts.append(f"messages=[{inner}]")
        else:
            parts.append(f"{k}={_type(v)}")
    return f"{path} {'stream ' if stream else ''}{' '.join(parts)}"


#: How a case is made: every field valid; all valid but one; each field
#: valid or not at random; or junk on the wire (weights).
MODES = {"valid": 6, "one invalid": 3, "wild": 2, "junk": 1}


def cases(vocab: int) -> Any:
    """The hypothesis strategy of :class:`Case` for a model whose logits
    have ``vocab`` entries."""
    from hypothesis import strategies as st

    big = st.one_of(st.integers(2**31, 2**70), st.integers(-(2**70), -(2**31)))
    junk = st.one_of(
        st.none(), st.booleans(), st.integers(-5, 5), big,
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
        st.lists(st.integers(0, 9), max_size=3),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    unicode = st.sampled_from(["héllo wörld", "日本語のテキスト", "emoji 🚀🔥", "مرحبا بالعالم",
                               "\u202eevil\u202c", "nul\x00byte", "tab\tnew\nline", "\ud800 lone"])
    words = st.sampled_from([
        "Repeat after me: one two three four five six", "def add(a, b):\n    return a + b",
        '{"tool": "grep", "arguments": {"pattern": "def main"}}', "Summarise: the cat sat.",
        "hi", "x",
    ])
    text = st.one_of(words, words, unicode, st.text(min_size=1, max_size=80),
                     st.integers(500, 4000).map(lambda n: ("lorem ipsum " * n)[:n]))
    floats01 = st.floats(0, 1)
    nan_inf = st.sampled_from([float("nan"), float("inf"), -float("inf")])
    ctx = (st.integers(0, 64), st.one_of(big, st.integers(-3, -1), junk))
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
            st.just({"url": "data:image/png;base64,AAAA"}), st.just("data:,junk"), junk)}),
        st.fixed_dictionaries({"type": junk}), junk,
    )
    bad_message = st.one_of(
        st.fixed_dictionaries({"content": text}),
        st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["tool", "x"]), junk),
                               "content": text}),
        st.fixed_dictionaries({"role": st.just("user"),
                               "content": st.one_of(st.none(), st.lists(part, max_size=3), junk)}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": text, "tool_calls": junk}),
        junk)
    history = st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "assistant", "user"]), "content": text}), max_size=2)
    # name -> (valid values, invalid values and types)
    fields = {
        "messages": (st.tuples(history, text).map(lambda t: t[0] + [{"role": "user", "content": t[1]}]),
                     st.one_of(st.just([]), st.lists(bad_message, min_size=1, max_size=3), junk)),
        "prompt": (text, st.one_of(st.just(""), st.lists(st.integers(0, vocab - 1), max_size=4), junk)),
        "stream": (st.booleans(), junk),
        "max_tokens": (st.integers(1, 16), st.one_of(st.integers(-2, 0), junk, st.just(10**30))),
        "max_completion_tokens": (st.integers(1, 16), st.one_of(st.integers(-2, 0), junk)),
        "temperature": (st.one_of(st.just(0), st.just(0.0), st.just(0), st.floats(0, 2)),
                        st.one_of(st.floats(-2, -0.01), nan_inf, big, junk)),
        "top_p": (floats01, st.one_of(st.floats(1.01, 5), nan_inf, junk)),
        "top_k": (st.integers(0, vocab - 1), st.one_of(st.integers(vocab, vocab + 100), big, junk)),
        "min_p": (floats01, st.one_of(nan_inf, st.floats(1.01, 3), junk)),
        "repetition_penalty": (st.floats(0, 3), st.one_of(st.floats(-2, -0.1), nan_inf, big, junk)),
        "presence_penalty": (st.floats(-2, 2), st.one_of(nan_inf, big, junk)),
        "frequency_penalty": (st.floats(-2, 2), st.one_of(nan_inf, big, junk)),
        "repetition_context_size": ctx,
        "presence_context_size": ctx,
        "frequency_context_size": ctx,
        "xtc_probability": (floats01, st.one_of(nan_inf, st.integers(0, 1), junk)),
        "xtc_threshold": (floats01, st.one_of(nan_inf, st.floats(1.01, 2), junk)),
        "logit_bias": (
            st.dictionaries(st.integers(0, vocab - 1).map(str), st.floats(-100, 100), max_size=4),
            st.one_of(st.dictionaries(st.one_of(st.integers(-5, -1).map(str), st.text(max_size=4)),
                                      junk, min_size=1, max_size=2),
                      st.dictionaries(st.integers(0, vocab - 1).map(str), junk, min_size=1,
                                      max_size=2),
                      st.just({str(vocab): 1.0}), junk)),
        "logprobs": (st.booleans(), junk),
        "top_logprobs": (st.integers(-1, 11), st.one_of(st.integers(-3, -2), st.integers(12, 15),
                                                        junk)),
        "seed": (st.integers(0, 2**64 - 1), st.one_of(st.integers(-(2**70), -1),
                                                      st.integers(2**64, 2**70), junk)),
        "stop": (st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)), junk),
        "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                           st.one_of(st.just({}), st.just({"other": 1}), junk)),
        "model": (st.just("default_model"),
                  st.one_of(st.sampled_from(["", "nope/none", "./missing", "😀"]), junk)),
        "draft_model": (st.sampled_from(["suffix", None, "default_model"]),
                        st.one_of(st.text(max_size=6), junk)),
        "num_draft_tokens": (st.integers(0, 128), st.one_of(st.integers(-3, -1), big, junk)),
        "adapters": (st.none(), st.one_of(st.sampled_from(["./missing-adapter", ""]), junk)),
        "chat_template_kwargs": (st.fixed_dictionaries({"enable_thinking": st.booleans()}),
                                 st.one_of(st.dictionaries(st.text(max_size=5), junk, max_size=2),
                                           junk)),
        "tools": (st.just([{"type": "function", "function": {"name": "grep", "parameters": {}}}]),
                  st.one_of(st.lists(junk, max_size=2), junk)),
        "role_mapping": (st.just({"user": "U: "}), junk),
        "user": (st.text(max_size=8), junk),
    }
    extra = st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in fields),
                            junk, min_size=1, max_size=2)
    optional = sorted(set(fields) - {"messages", "prompt", "stream"})
    header = st.tuples(
        st.sampled_from(["X-Forwarded-User", "Authorization", "X-Junk", "Accept", "User-Agent"]),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40))

    @st.composite
    def case(draw) -> Case:
        mode = draw(st.sampled_from([m for m, w in MODES.items() for _ in range(w)]))
        path = draw(st.sampled_from([CHAT, CHAT, TEXT, TEXT, "/chat/completions"]
                                    + (["/v1/nothing", CHAT + "?x=1"] if mode != "valid" else [])))
        headers = draw(st.lists(header, max_size=2))
        if mode == "junk":
            return _junk_case(draw, st, path, headers, junk)
        main = "prompt" if path.startswith(TEXT) else "messages"
        names = [main, "stream"] + draw(st.lists(st.sampled_from(optional), max_size=5, unique=True))
        if mode == "wild" and draw(st.integers(0, 9)) == 0:
            names.remove(main)  # missing
        wrong = {draw(st.sampled_from(names))} if mode == "one invalid" else set()
        body: Dict[str, Any] = {}
        for name in names:
            invalid = name in wrong or (mode == "wild" and draw(st.booleans()))
            body[name] = draw(fields[name][1 if invalid else 0])
        if mode != "valid" and draw(st.integers(0, 4)) == 0:
            body.update(draw(extra))
        if body["stream"] is not True and body.get("max_tokens") == 10**30:
            body["stream"] = True  # a client reads a never-ending answer as a stream
        case = json_case(body, path)
        case.headers += headers
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if case.stream and (not isinstance(limit, int) or limit > CUT_EVENTS):
            case.cut = CUT_EVENTS
        return case

    return case()


def _junk_case(draw: Any, st: Any, path: str, headers: List[Tuple[str, str]], junk: Any) -> Case:
    """Junk on the wire: bytes, not UTF-8, JSON that is no object or nests
    deeper than the parser goes, the wrong Content-Type, a Content-Length
    missing, not a number, negative or short of the body."""
    kind = draw(st.sampled_from(["bytes", "not utf-8", "not an object", "nested",
                                 "content type", "content length"]))
    body: Any = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    raw = json.dumps(body).encode()
    content_type, length = "application/json", str(len(raw))
    if kind == "bytes":
        raw = draw(st.binary(max_size=200))
        length = str(len(raw))
    elif kind == "not utf-8":
        raw = b'{"messages": "\xff\xfe"}'
        length = str(len(raw))
    elif kind == "not an object":
        body = draw(st.one_of(st.lists(junk, max_size=3), junk))
        raw = json.dumps(body).encode()
        length = str(len(raw))
    elif kind == "nested":
        depth = draw(st.integers(200, 3000))
        kind = f"nested {depth // 500 * 500}+"
        raw = ('{"messages": ' + "[" * depth + "]" * depth + "}").encode()
        length = str(len(raw))
    elif kind == "content type":
        content_type = draw(st.sampled_from(["text/plain", "", "x/y; a=b"]))
    else:
        length = draw(st.sampled_from([None, "x", "-5", str(len(raw) - 3)]))
        kind = f"content length {'missing' if length is None else length}"
    wire = [("Content-Type", content_type)] + ([("Content-Length", length)] if length else [])
    return Case(path, wire + headers, raw, shape=shape_of(path, body, False, kind))


def json_case(body: Any, path: str = CHAT) -> Case:
    """A well-formed JSON POST of ``body``."""
    raw = json.dumps(body).encode()
    stream = isinstance(body, dict) and body.get("stream") is True
    return Case(path, [("Content-Type", "application/json"), ("Content-Length", str(len(raw)))],
                raw, body if isinstance(body, dict) else None, stream, None,
                shape_of(path, body, stream))


# ---------------------------------------------------------------- answers
@dataclass
class Answer:
    """What a server did with a case. ``kind``: "ok" (200, a whole answer
    or stream), "cut" (200, a stream the client closed), "4xx", "5xx",
    "error-event" (200, a stream ending in an error event: ``status`` then
    holds its code), "broken" (200, a stream ending without [DONE]),
    "dropped" (no answer), "hang" (none in :data:`TIMEOUT_S`)."""

    kind: str
    status: Optional[int] = None
    text: Optional[str] = None
    finish: Optional[str] = None
    error: Any = None
    events: List[str] = field(default_factory=list)

    @property
    def clear_4xx(self) -> bool:
        if self.kind == "error-event":
            return self.status is not None and 400 <= self.status < 500 and bool(self.error)
        return self.kind == "4xx" and isinstance(self.error, (str, dict)) and bool(self.error)


def send(port: int, case: Case, timeout: float = TIMEOUT_S) -> Answer:
    """Send ``case`` on a fresh connection and read the answer."""
    head = f"POST {case.path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in case.headers) + "\r\n"
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(head.encode("latin-1") + case.body)
            return _read(s, case, time.monotonic() + timeout)
    except socket.timeout:
        return Answer("hang")
    except (ConnectionResetError, BrokenPipeError):
        return Answer("dropped")


def _read(s: socket.socket, case: Case, deadline: float) -> Answer:
    data, head = b"", None
    while True:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        if head is None and b"\r\n\r\n" in data:
            head, data = data.split(b"\r\n\r\n", 1)
        if head is not None and case.cut is not None and b"text/event-stream" in head:
            events = _events(data)
            if len(events) > case.cut:  # (the last one may be incomplete)
                return _stream_answer(events[: case.cut], cut=True)
        if time.monotonic() > deadline:
            return Answer("hang")
    if head is None:
        return Answer("dropped") if not data else Answer("broken", error=data[:200])
    status = int(head.split(b" ", 2)[1])
    if b"text/event-stream" in head and status == 200:
        return _stream_answer(_events(data), cut=False)
    try:
        reply = json.loads(data)
    except ValueError:
        reply = {"error": None, "raw": data[:200].decode("latin-1")}
    if status == 200:
        choice = (reply.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
        return Answer("ok", status, text or "", choice.get("finish_reason"))
    kind = "4xx" if 400 <= status < 500 else "5xx"
    return Answer(kind, status, error=reply.get("error") if isinstance(reply, dict) else None)


def _events(data: bytes) -> List[str]:
    return [line[6:] for line in data.decode("utf-8", "replace").split("\n")
            if line.startswith("data: ")]


def _stream_answer(events: List[str], cut: bool) -> Answer:
    text, finish = "", None
    for e in events:
        if e == "[DONE]":
            return Answer("ok", 200, text, finish, events=events)
        try:
            event = json.loads(e)
        except ValueError:
            return Answer("broken", 200, text, error=e[:200], events=events)
        if "error" in event:
            err = event["error"]
            code = err.get("code") if isinstance(err, dict) else None
            return Answer("error-event", code, text, error=err, events=events)
        for c in event.get("choices", []):
            text += (c.get("delta") or {}).get("content") or c.get("text") or ""
            finish = c.get("finish_reason") or finish
    return Answer("cut" if cut else "broken", 200, text, finish, events=events)


def stock_failed(stock: Answer) -> bool:
    """Whether stock failed (rather than answered, or refused)."""
    return stock.kind in ("5xx", "dropped", "hang", "broken", "error-event") or (
        stock.kind == "4xx" and "generation thread died" in str(stock.error))


def compare(case: Case, stock: Answer, suffix: Answer) -> Optional[str]:
    """What is wrong with the suffix server's answer to ``case`` given
    stock's (None: nothing); :func:`intended` tells the intended differences."""
    if suffix.kind in ("5xx", "dropped", "hang", "broken") or (
            suffix.kind == "error-event" and not suffix.clear_4xx):
        return f"suffix server: {suffix.kind} {suffix.status} {str(suffix.error)[:120]}"
    if suffix.kind == "4xx" and not suffix.clear_4xx and (stock.kind, stock.status) != (
            "4xx", suffix.status):  # (stock's own plain 404 of an unknown path, say)
        return f"suffix server: a 4xx without an error message ({suffix.status})"
    if stock_failed(stock):
        return None  # a clear 4xx or a whole answer (both checked above)
    answered = ("ok", "cut")
    if (stock.kind in answered) != (suffix.kind in answered):
        return f"status class: stock {stock.kind} {stock.status}, suffix {suffix.kind} {suffix.status}"
    if stock.kind in answered and case.greedy():
        if stock.kind == "cut" or suffix.kind == "cut":
            n = min(len(stock.events), len(suffix.events))
            if _stream_answer(stock.events[:n], True).text != _stream_answer(suffix.events[:n], True).text:
                return "greedy stream differs from stock's"
        elif (stock.text, stock.finish) != (suffix.text, suffix.finish):
            return f"greedy answer differs: stock {stock.text!r:.80} {stock.finish}, suffix {suffix.text!r:.80} {suffix.finish}"
    return None


def intended(case: Case, stock: Answer, suffix: Answer) -> Optional[str]:
    """The name of the :data:`INTENDED` difference the answers to ``case`` are."""
    if not isinstance(case.fields, dict):
        return None
    return next((name for name, (test, _) in INTENDED.items()
                 if test(case.fields, stock, suffix)), None)


# -------------------------------------------------------------------- run
class _Servers:
    """The stock and suffix servers, started again when one dies."""

    def __init__(self, model: str, logs: Path, draft_model: Optional[str] = None,
                 policy: str = "adaptive"):
        self.model, self.logs = model, logs
        self.restarts = {"stock": 0, "suffix": 0}
        common = ["--max-tokens", str(SERVER_MAX_TOKENS)]
        # Stock: mlx-lm not patched at all; no hub (a model name that is not
        # a folder fails at once).
        self.args = {"stock": common, "suffix": [
            *common, *suffix_args(policy, draft_model),
            "--suffix-max-cached-requests", str(CACHED_REQUESTS),
            "--suffix-max-cached-tokens", str(CACHED_TOKENS)]}
        self.env = {"stock": {"MLX_LM_SUFFIX_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1"},
                    "suffix": {"HF_HUB_OFFLINE": "1"}}
        self.servers = {name: self._start(name) for name in ("stock", "suffix")}

    def _start(self, name: str) -> SoakServer:
        return SoakServer(self.model, *self.args[name], env=self.env[name],
                          log=self.logs / f"{name}.log", append_log=True)

    def port(self, name: str) -> int:
        return self.servers[name].port

    def healthy(self, name: str) -> bool:
        server = self.servers[name]
        probe = json_case({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        return server.proc.poll() is None and send(server.port, probe, timeout=30).kind == "ok"

    def restart(self, name: str) -> None:
        self.servers[name].stop()
        self.restarts[name] += 1
        self.servers[name] = self._start(name)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


class _Witness:
    """A greedy request sent to the suffix server beside each case: its
    answer must stay stock's (``reference``)."""

    def __init__(self, reference: Optional[str]):
        self.reference = reference
        self.body = json_case(WITNESS)
        self.sent, self.harmed = 0, []

    def beside(self, port: int) -> threading.Thread:
        """Send the witness request in a thread (join it)."""
        def run() -> None:
            answer = send(port, self.body)
            self.sent += 1
            if answer.kind != "ok" or answer.text != self.reference:
                self.harmed.append(f"{answer.kind} {answer.status} {answer.text!r:.60} "
                                   f"{str(answer.error)[:100]}")

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


#: The witness's request.
WITNESS = {"messages": [{"role": "user", "content": "witness: " + "alpha beta " * 6}],
           "max_tokens": SERVER_MAX_TOKENS, "temperature": 0}


def run_fuzz(
    model: Optional[str] = None,
    examples: int = 300,
    seed: int = 0,
    log_dir: Optional[str] = None,
    json_out: Optional[str] = None,
    witness: bool = True,
    echo: Callable[[str], None] = print,
    draft_model: Optional[str] = None,
    policy: str = "adaptive",
) -> Dict[str, Any]:
    """Run ``examples`` generated requests against a stock and a suffix
    server (``model``: default the tiny test model; ``draft_model``: the
    suffix server's, where it has one; ``policy``: its draft policy);
    returns (and writes to
    ``json_out``) a summary whose ``ok`` says whether there were no
    findings and memory stayed within :data:`RSS_LIMIT_MB`."""
    import tempfile

    import psutil
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    if model is None:
        from .models import ensure_model

        model = str(ensure_model("qwen3", "tiny"))
    vocab = _vocabulary(model)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mlx-lm-suffix-fuzz-"))
    logs.mkdir(parents=True, exist_ok=True)
    echo(f"fuzz: model {model} (logits {vocab})"
         + (f", the suffix server's draft model {draft_model}" if draft_model else "")
         + f"; logs in {logs}")
    t0 = time.monotonic()
    servers = _Servers(model, logs, draft_model, policy)
    watcher = _Witness(send(servers.port("stock"), json_case(WITNESS)).text) if witness else None
    rss: List[Tuple[int, float]] = []
    tally: Dict[str, Any] = {"sent": 0, "shapes": set(), "findings": [], "intended": {},
                             "stock_failed": {}, "stock_failures": [], "outcomes": {},
                             "previous": None}

    def sample_rss() -> None:
        proc = psutil.Process(servers.servers["suffix"].proc.pid)
        rss.append((tally["sent"], proc.memory_info().rss / 2**20))

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @with_seed(seed)
    @given(cases(vocab))
    def one(case: Case) -> None:
        stock = send(servers.port("stock"), case)
        beside = watcher.beside(servers.port("suffix")) if watcher else None
        suffix = send(servers.port("suffix"), case)
        if beside is not None:
            beside.join(TIMEOUT_S)
        tally["sent"] += 1
        tally["shapes"].add(case.shape)
        key = f"stock {stock.kind} / suffix {suffix.kind}"
        tally["outcomes"][key] = tally["outcomes"].get(key, 0) + 1
        problem = compare(case, stock, suffix)
        name = intended(case, stock, suffix)
        if problem is not None and name is not None:
            tally["intended"][name] = tally["intended"].get(name, 0) + 1
            problem = None
        if problem is not None:
            tally["findings"].append({"problem": problem, "shape": case.shape, "path": case.path,
                                      "headers": case.headers,
                                      "body": case.body.decode("utf-8", "replace")})
            echo(f"fuzz: FINDING {problem} [{case.shape[:160]}]")
        if stock_failed(stock):
            tally["stock_failed"][stock.kind] = tally["stock_failed"].get(stock.kind, 0) + 1
            restart = not servers.healthy("stock")
            tally["stock_failures"].append({
                "stock": f"{stock.kind} {stock.status} {str(stock.error)[:100]}",
                "suffix": f"{suffix.kind} {suffix.status} {str(suffix.error)[:160]}",
                "stock_restarted": restart, "shape": case.shape, "headers": case.headers,
                "body": case.body[:300].decode("utf-8", "replace"),
                # (a generation thread that died answers the next request)
                "previous": tally["previous"]})
            if restart:
                servers.restart("stock")
        tally["previous"] = {"stock": f"{stock.kind} {stock.status}", "shape": case.shape,
                             "body": case.body[:300].decode("utf-8", "replace")}
        if suffix.kind not in ("ok", "cut", "4xx") and not servers.healthy("suffix"):
            tally["findings"].append({"problem": "suffix server unhealthy after it",
                                      "shape": case.shape,
                                      "body": case.body.decode("utf-8", "replace")})
            servers.restart("suffix")
        if tally["sent"] % 10 == 1:
            sample_rss()
        if tally["sent"] % 100 == 0:
            echo(f"fuzz: {tally['sent']}/{examples} examples, {len(tally['shapes'])} shapes, "
                 f"{len(tally['findings'])} findings, {time.monotonic() - t0:.0f} s")

    try:
        one()
        sample_rss()
        suffix_stats = servers.servers["suffix"].stats()
        suffix_log = servers.servers["suffix"].log()
    finally:
        servers.stop()
    warm = [r for n, r in rss if n <= max(1, tally["sent"] // 5)][-1:] or [rss[0][1]]
    growth = max(r for _, r in rss) - warm[0]
    result = {
        "model": model,
        "draft_model": draft_model,
        "policy": policy,
        "seed": seed,
        "examples": tally["sent"],
        "shapes": len(tally["shapes"]),
        "findings": tally["findings"],
        "intended": tally["intended"],
        "stock_failed": tally["stock_failed"],
        "stock_restarts": servers.restarts["stock"],
        "stock_failures": tally["stock_failures"],
        "suffix_restarts": servers.restarts["suffix"],
        "outcomes": dict(sorted(tally["outcomes"].items(), key=lambda kv: -kv[1])),
        "witness": {"sent": watcher.sent, "harmed": watcher.harmed} if watcher else None,
        "source_drafted": counts_by_source(suffix_stats, "source_drafted"),
        "source_accepted": counts_by_source(suffix_stats, "source_accepted"),
        "generation_loop_failures": suffix_log.count("the generation loop failed"),
        "rows_failed_alone": suffix_log.count("the request fails alone"),
        "rss_mb": {"first": round(rss[0][1], 1), "warm": round(warm[0], 1),
                   "max": round(max(r for _, r in rss), 1), "last": round(rss[-1][1], 1),
                   "samples": len(rss)},
        "rss_growth_after_warmup_mb": round(growth, 1),
        "rss_growth_limit_mb": RSS_LIMIT_MB,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "log_dir": str(logs),
    }
    result["ok"] = (not result["findings"] and growth <= RSS_LIMIT_MB
                    and not (watcher and watcher.harmed) and result["suffix_restarts"] == 0)
    echo(
        f"fuzz: {result['examples']} examples ({result['shapes']} distinct shapes) in "
        f"{result['elapsed_s']} s; findings {len(result['findings'])}; intended differences "
        f"{sum(result['intended'].values())}; stock failed {sum(result['stock_failed'].values())} "
        f"times (restarted {result['stock_restarts']}), suffix restarted "
        f"{result['suffix_restarts']}; witness "
        f"{result['witness']['sent'] if watcher else 0} requests, "
        f"{len(watcher.harmed) if watcher else 0} harmed; rows failed alone "
        f"{result['rows_failed_alone']}, generation loop failures "
        f"{result['generation_loop_failures']}; the suffix server drafted "
        f"{result['source_drafted']}, accepted {result['source_accepted']}\n"
        f"fuzz: suffix RSS first {result['rss_mb']['first']} MB, warm {result['rss_mb']['warm']}, "
        f"max {result['rss_mb']['max']}, last {result['rss_mb']['last']}; growth after warm-up "
        f"{result['rss_growth_after_warmup_mb']}/{RSS_LIMIT_MB:.1f} MB\n"
        f"fuzz: {'OK' if result['ok'] else 'FAILED'}"
    )
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def _vocabulary(model: str) -> int:
    """The length of ``model``'s logits (its config's vocab_size)."""
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])

