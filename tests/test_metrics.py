"""``GET /metrics`` and the ``SpecDecoding metrics`` log line of a
``--draft suffix`` server (issue 53), checked against what was sent: the
bench's agentic workload (scripted: the answers follow its references, so
drafts are accepted) at concurrency 4, streamed and not, plus refused and
unknown requests and a stream the client cuts. The scrape is parsed with
``prometheus_client``'s own parser; its counters must equal the sums of the
responses' ``usage`` and the stats endpoint's counters.
"""

import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_lm  # noqa: F401  (first: mlx_lm_suffix imports mlx_lm)
import pytest

from mlx_lm_suffix.metrics import log_line, samples, total
from mlx_lm_suffix.tools import bench, workloads
from mlx_lm_suffix.tools.launcher import free_ports

sys.path.insert(0, str(Path(__file__).parent))
from test_server import Server, _messages  # noqa: E402

MAX_TOKENS = 96
LOG_INTERVAL = 0.5
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("metrics-logs")


@pytest.fixture(scope="module")
def agentic(tiny_model_path, logs):
    """The bench's agentic requests and a scripted suffix server for them."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    requests = bench.load_requests(workloads.build("agentic", 12), tokenizer)
    script = bench.write_script(logs / "agentic.jsonl", requests)
    server = bench.server_process(
        str(tiny_model_path), suffix=True, script=script, eos_id=tokenizer.eos_token_id,
        extra_args=["--suffix-policy", "fixed", "--suffix-log-interval", str(LOG_INTERVAL)],
        log=logs / "agentic.log")
    yield requests, server
    server.stop()


def scrape(url):
    """{(metric sample name, sorted label items): value} of a scrape."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return samples(r.read().decode())


def send(url, body, stream):
    """POST a chat completion; (status, finish_reason, usage)."""
    body = dict(body, stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    req = urllib.request.Request(url + CHAT, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            if not stream:
                reply = json.loads(r.read())
                return r.status, reply["choices"][0]["finish_reason"], reply["usage"]
            finish, usage = None, None
            for line in r:
                payload = line.strip()[len("data:"):].strip() if line.startswith(b"data:") else b""
                if payload and payload != b"[DONE]":
                    event = json.loads(payload)
                    usage = event.get("usage") or usage
                    for c in event["choices"]:
                        finish = c["finish_reason"] or finish
            return r.status, finish, usage
    except urllib.error.HTTPError as e:
        return e.code, None, None


def run_workload(url, requests):
    """The sessions at concurrency 4, turns in order, every other session
    streamed; returns the (status, finish_reason, usage) of each turn."""
    sessions = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)

    def session(i, turns):
        body = lambda r: {**r.body, "max_tokens": MAX_TOKENS, "temperature": 0}  # noqa: E731
        return [send(url, body(r), stream=i % 2 == 1) for r in turns]

    with ThreadPoolExecutor(4) as pool:
        done = [pool.submit(session, i, t) for i, t in enumerate(sessions.values())]
        return [turn for f in done for turn in f.result()]


def test_scrape_equals_usage_and_stats(agentic):
    requests, server = agentic
    turns = run_workload(server.url, requests)
    assert [t[0] for t in turns] == [200] * len(requests)
    # Refused (400, before generating) and unknown paths (404).
    bad = {"messages": _messages("hi"), "max_tokens": 4}
    assert send(server.url, {**bad, "num_draft_tokens": -1}, False)[0] == 400
    assert send(server.url, {**bad, "top_k": 10**6, "temperature": 1}, True)[0] == 400
    req = urllib.request.Request(server.url + "/v1/nothing", data=b"{}",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404

    stats = bench.server_stats(server.url)
    m = scrape(server.url)
    model = stats["models"][0]["model"]
    usage = [u for _, _, u in turns]
    drafted = sum(u["draft_tokens"] for u in usage)
    accepted = sum(u["accepted_draft_tokens"] for u in usage)
    assert accepted > len(requests) * 10  # the scripted answers were drafted
    spec = "mlx_lm_suffix_spec_decode_num_"
    assert total(m, spec + "draft_tokens_total", model=model) == drafted == stats["drafted"]
    assert total(m, spec + "accepted_tokens_total", model=model) == accepted == stats["accepted"]
    assert total(m, spec + "drafts_total") == stats["models"][0]["draft_steps"]
    assert total(m, spec + "accepted_tokens_total", source="tree") > 0
    # Position i counts the drafts whose token i was accepted: over all
    # positions, every accepted token once; at 0, at most every draft.
    assert total(m, spec + "accepted_tokens_per_pos_total") == accepted
    assert total(m, spec + "accepted_tokens_per_pos_total", position="0") <= total(
        m, spec + "drafts_total")
    snapshot = stats["models"][0]
    for key, name in (("cached_requests", "cache_requests"), ("cached_tokens", "cache_tokens"),
                      ("active_requests", "cache_active_requests"), ("tokens", "decode_tokens_total"),
                      ("steps", "decode_steps_total")):
        assert total(m, "mlx_lm_suffix_" + name) == stats[key], name
    assert total(m, "mlx_lm_suffix_cache_evictions_total") == snapshot["evictions"]
    assert stats["cached_requests"] == len(requests) and stats["active_requests"] == 0
    # Requests by finish reason and HTTP status, tokens, latencies.
    finishes = Counter(f for _, f, _ in turns)
    for reason in ("stop", "length", "error", "abort"):
        assert total(m, "mlx_lm_suffix_requests_total", model=model,
                     finish_reason=reason) == finishes.get(reason, 0), reason
    http = "mlx_lm_suffix_http_requests_total"
    assert total(m, http, endpoint=CHAT, status="200") == len(requests)
    assert total(m, http, endpoint=CHAT, status="400") == 2
    assert total(m, http, endpoint="other", status="404") == 1
    assert total(m, "mlx_lm_suffix_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert total(m, "mlx_lm_suffix_generation_tokens_total") == sum(
        u["completion_tokens"] for u in usage)
    n = len(requests)
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert total(m, f"mlx_lm_suffix_{name}_count") == n
        assert total(m, f"mlx_lm_suffix_{name}_bucket", le="+Inf") == n
        assert 0 < total(m, f"mlx_lm_suffix_{name}_sum") < 120 * n
    assert total(m, "mlx_lm_suffix_time_per_output_token_seconds_count") == sum(
        u["completion_tokens"] > 1 for u in usage)
    assert total(m, "mlx_lm_suffix_info", scope="global", policy="fixed") == 1


def test_a_stream_cut_by_its_client_counts_as_abort(agentic):
    _, server = agentic
    before = scrape(server.url)
    body = json.dumps({"messages": _messages("cut: " + "alpha beta " * 20), "max_tokens": 2000,
                       "temperature": 0, "num_draft_tokens": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", CHAT, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"data:"):  # (keepalive lines first)
        pass
    response.close()  # (it holds the socket open too)
    conn.close()
    deadline = time.monotonic() + 60
    while True:
        m = scrape(server.url)
        aborted = (total(m, "mlx_lm_suffix_requests_total", finish_reason="abort")
                   - total(before, "mlx_lm_suffix_requests_total", finish_reason="abort"))
        if aborted or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 1
    assert total(m, "mlx_lm_suffix_http_requests_total", status="200") == total(
        before, "mlx_lm_suffix_http_requests_total", status="200") + 1


def test_log_line_counts_every_draft(agentic):
    """Every interval with traffic logs one line: its Accepted and Drafted
    figures sum to the server's totals."""
    _, server = agentic
    stats = bench.server_stats(server.url)
    deadline = time.monotonic() + 30
    while True:
        lines = [ln for ln in server.log().splitlines() if "SpecDecoding metrics:" in ln]
        sums = [sum(int(ln.split(f"{what}: ")[1].split(" ")[0]) for ln in lines)
                for what in ("Accepted", "Drafted")]
        if sums == [stats["accepted"], stats["drafted"]] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sums == [stats["accepted"], stats["drafted"]], lines
    assert all(" - INFO - " in ln and "Model: " in ln for ln in lines)
    rates = lines[-1].split("Per-position acceptance rate: ")[1].split(", Refused")[0]
    assert all(0 <= float(r) <= 1 for r in rates.split(", ") if r != "-")


def test_log_line_over_an_interval():
    before = {"steps": 10, "accepted": 5, "drafted": 8, "refused": 1,
              "source_drafts": {"tree": 2}, "accepted_per_position": {"0": 2, "1": 1}}
    after = {"steps": 30, "accepted": 25, "drafted": 38, "refused": 4,
             "source_drafts": {"tree": 6, "copy": 4}, "accepted_per_position":
             {"0": 10, "1": 7, "2": 5, "3": 1}}
    assert log_line(before, after, 2.0) == (
        "SpecDecoding metrics: Mean acceptance length: 3.50, Accepted throughput: 10.00 "
        "tokens/s, Drafted throughput: 15.00 tokens/s, Accepted: 20 tokens, Drafted: 30 "
        "tokens, Per-position acceptance rate: 1.000, 0.750, 0.625, 0.125, Refused drafts: 3")
    assert log_line(after, after, 2.0) is None  # no forward: no line


def test_private_scope_hides_traffic_but_the_operator_port(tiny_model_path, logs):
    """--suffix-cache-scope user: GET /metrics shows any caller the
    settings only; --suffix-metrics-port shows the operator everything."""
    port = free_ports()
    server = Server(tiny_model_path, "--draft", "suffix", "--suffix-cache-scope", "user",
                    "--suffix-metrics-port", str(port), log_dir=logs, name="private")
    try:
        for key in ("key-a", "key-b"):
            status, _ = server.post(CHAT, {"messages": _messages("hello " * 8), "max_tokens": 8,
                                           "temperature": 0}, {"Authorization": f"Bearer {key}"})
            assert status == 200
        public = scrape(server.url)
        assert {n for n, _ in public} == {"mlx_lm_suffix_info"}
        assert total(public, "mlx_lm_suffix_info", scope="user") == 1
        operator = scrape(f"http://127.0.0.1:{port}")
        assert total(operator, "mlx_lm_suffix_requests_total") == 2
        assert total(operator, "mlx_lm_suffix_decode_tokens_total") > 0
    finally:
        server.stop()


def test_stock_server_has_no_metrics(tiny_model_path, logs):
    server = Server(tiny_model_path, log_dir=logs, name="stock")
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(server.url)
        assert e.value.code == 404
    finally:
        server.stop()


def test_metrics_flags_need_draft_suffix(tiny_model_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "mlx_lm.server", "--model", str(tiny_model_path),
                          "--suffix-metrics-port", "9999"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--suffix-metrics-port needs --draft suffix" in out.stderr
    out = subprocess.run([sys.executable, "-m", "mlx_lm.server", "--model", str(tiny_model_path),
                          "--draft", "suffix", "--suffix-log-interval", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--suffix-log-interval" in out.stderr
