"""Soak test of ``mlx_lm.server --draft suffix`` (``mlx-lm-suffix soak``).

Starts a stock server (reference greedy outputs) and a suffix server with
small cache bounds on loopback, sends a bounded number of requests at mixed
concurrency (rounds of 1..max concurrent requests, repeated prompts, some
streamed and cut off by the client), and checks:

- every completed greedy output equals the stock server's for that prompt;
- no request is left active in the drafter at the end;
- cached requests and tokens stay within the configured bounds (the stats
  endpoint is polled during the run): the drafter's counters, and apart from
  them the responses the suffix trees themselves hold (``tree_responses``);
  at the end the trees hold exactly the cached responses;
- the server process's RSS stays bounded: its growth from the end of the
  warm-up (the first fifth of the requests) to its peak is below
  ``rss_growth_limit_mb`` (default: :data:`RSS_SLACK_MB` plus
  :data:`TREE_BYTES_PER_TOKEN` per token of ``max_cached_tokens``), sampled
  with psutil; first, warm, peak, last and the slope over the second half are
  reported.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..patches.serving import STATS_PATH
from .launcher import HOST, ServerProcess

__all__ = ["run_soak", "RSS_SLACK_MB", "TREE_BYTES_PER_TOKEN"]

# Suffix-tree memory per cached token, a bound: arctic-inference estimates
# about 300-330 bytes per token of random responses at depth 64.
TREE_BYTES_PER_TOKEN = 1024
# RSS growth allowed besides the trees: allocator and MLX buffer-cache noise.
RSS_SLACK_MB = 64.0


class SoakServer(ServerProcess):
    """A server with the soak's requests and its stats (the fuzzer's too)."""

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def stats(self) -> Dict[str, Any]:
        return self._get(STATS_PATH)

    def chat(self, body: Dict[str, Any], cut_after: Optional[int] = None,
             timeout: float = 300) -> Tuple[str, Optional[str]]:
        """POST a chat completion; returns (text, finish_reason). With
        ``cut_after``, stream and close the connection after that many
        events (returns the text so far, finish None)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            stream = cut_after is not None or body.get("stream", False)
            body = dict(body, stream=stream)
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
            if not stream:
                data = json.loads(r.read())
                choice = data["choices"][0]
                return choice["message"]["content"], choice["finish_reason"]
            text, finish, events = "", None, 0
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                for choice in event.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
                    finish = choice.get("finish_reason") or finish
                events += 1
                if cut_after is not None and events >= cut_after:
                    return text, None  # client disconnects (conn.close below)
            return text, finish
        finally:
            conn.close()


def _prompts(n: int, seed: int) -> List[str]:
    """Distinct prompts: pieces of stdlib source (deterministic), some
    repetitive so that drafts from the prompt tree get accepted too."""
    import inspect

    text = Path(inspect.getsourcefile(inspect)).read_text()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(0, max(1, len(text) - 400))
        piece = text[start : start + rng.randrange(60, 300)]
        if i % 4 == 3:
            piece = f"Repeat {i}: " + " ".join([piece[:40]] * 4)
        out.append(f"[{i}] {piece}")
    return out


def _slope_mb_per_min(samples: List[Tuple[float, int]]) -> float:
    if len(samples) < 2:
        return 0.0
    ts = [t for t, _ in samples]
    ys = [r / 2**20 for _, r in samples]
    tm, ym = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - tm) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return 60 * sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / var


def suffix_args(policy: str = "adaptive", draft_model: Optional[str] = None) -> List[str]:
    """A suffix server's drafting arguments: ``--draft suffix`` with
    ``policy``, paired with ``draft_model`` where one is given."""
    return ["--draft", "suffix", "--suffix-policy", policy,
            *(["--draft-model", draft_model] if draft_model else [])]


def counts_by_source(stats: Dict[str, Any], key: str) -> Dict[str, int]:
    """A per-source count (``source_drafted``, ``source_accepted``) of a
    stats body, summed over its models."""
    out: Dict[str, int] = {}
    for m in stats.get("models", []):
        for source, n in (m.get(key) or {}).items():
            out[source] = out.get(source, 0) + n
    return out


def run_soak(
    model: Optional[str] = None,
    requests: int = 500,
    max_tokens: int = 32,
    max_concurrency: int = 8,
    distinct_prompts: int = 40,
    disconnect_rate: float = 0.15,
    max_cached_requests: int = 50,
    max_cached_tokens: int = 20000,
    seed: int = 0,
    rss_interval: float = 2.0,
    stats_interval: float = 0.5,
    rss_growth_limit_mb: Optional[float] = None,
    log_dir: Optional[str] = None,
    json_out: Optional[str] = None,
    echo: Callable[[str], None] = print,
    draft_model: Optional[str] = None,
    policy: str = "adaptive",
) -> Dict[str, Any]:
    """Run the soak; returns (and optionally writes) a summary dict whose
    ``ok`` says whether every check passed. The suffix server runs with
    ``policy`` (``--suffix-policy``; ``fixed`` drafts as proposed, so a
    draft model drafts even where its forward costs what the target's
    does), and pairs ``draft_model`` where one is given
    (``--draft-model``; the stock server that gives the reference outputs
    has none)."""
    import tempfile

    import psutil

    if model is None:
        from .models import ensure_model

        model = str(ensure_model("qwen3", "tiny"))
    if rss_growth_limit_mb is None:
        rss_growth_limit_mb = RSS_SLACK_MB + max_cached_tokens * TREE_BYTES_PER_TOKEN / 2**20
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mlx-lm-suffix-soak-"))
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    prompts = _prompts(distinct_prompts, seed)
    t_start = time.monotonic()

    def body(i: int) -> Dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": prompts[i]}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }

    echo(f"soak: model {model}"
         + (f", the suffix server's draft model {draft_model}" if draft_model else "")
         + f"; logs in {logs}")
    with SoakServer(model, log=logs / "stock.log") as stock:
        reference = [stock.chat(body(i)) for i in range(distinct_prompts)]
    echo(f"soak: {distinct_prompts} reference outputs from the stock server "
         f"({time.monotonic() - t_start:.1f} s)")

    suffix = SoakServer(
        model,
        *suffix_args(policy, draft_model),
        "--suffix-max-cached-requests", max_cached_requests,
        "--suffix-max-cached-tokens", max_cached_tokens,
        log=logs / "suffix.log",
    )
    proc = psutil.Process(suffix.proc.pid)
    rss: List[Tuple[float, int]] = []
    seen = {"active": 0, "cached_requests": 0, "cached_tokens": 0, "tree_cached": 0,
            "polls": 0}
    warm_at: List[float] = []  # when the warm-up ended
    bound_violations: List[Dict[str, Any]] = []
    done = threading.Event()

    def monitor() -> None:
        next_rss = 0.0
        while not done.is_set():
            now = time.monotonic()
            if now >= next_rss:
                rss.append((now - t0, proc.memory_info().rss))
                next_rss = now + rss_interval
            try:
                s = suffix.stats()
            except (OSError, ValueError):
                s = None
            if s is not None:
                seen["polls"] += 1
                # Finished responses the trees hold, counted by the trees.
                s["tree_cached"] = s["tree_responses"] - s["active_requests"]
                for k, key in (("active", "active_requests"),
                               ("cached_requests", "cached_requests"),
                               ("cached_tokens", "cached_tokens"),
                               ("tree_cached", "tree_cached")):
                    seen[k] = max(seen[k], s[key])
                if (s["cached_requests"] > max_cached_requests
                        or s["tree_cached"] > max_cached_requests
                        or s["cached_tokens"] > max_cached_tokens):
                    bound_violations.append(
                        {k: s[k] for k in ("cached_requests", "tree_cached", "cached_tokens")})
            done.wait(stats_interval)

    counts = {"completed": 0, "disconnected": 0, "errors": 0, "stream": 0}
    mismatches: List[Dict[str, Any]] = []
    errors: List[str] = []
    lock = threading.Lock()

    def one(i: int, stream: bool, cut: Optional[int]) -> None:
        try:
            text, finish = suffix.chat(dict(body(i), stream=stream), cut_after=cut)
        except Exception as e:  # noqa: BLE001 - counted and reported
            with lock:
                counts["errors"] += 1
                errors.append(f"prompt {i}: {type(e).__name__}: {e}"[:300])
            return
        with lock:
            counts["stream"] += stream
            if cut is not None:
                counts["disconnected"] += 1
                if not reference[i][0].startswith(text):
                    mismatches.append({"prompt": i, "kind": "prefix", "got": text,
                                       "want": reference[i][0]})
                return
            counts["completed"] += 1
            if (text, finish) != reference[i]:
                mismatches.append({"prompt": i, "got": [text, finish],
                                   "want": list(reference[i])})

    t0 = time.monotonic()
    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    sent = 0
    rounds = 0
    try:
        with ThreadPoolExecutor(max_concurrency) as pool:
            while sent < requests:
                c = min(rng.randint(1, max_concurrency), requests - sent)
                jobs = []
                for _ in range(c):
                    # Repeated prompts: a skewed choice over the distinct ones.
                    i = min(int(rng.expovariate(4.0 / distinct_prompts)), distinct_prompts - 1)
                    cut = rng.randint(1, max_tokens) if rng.random() < disconnect_rate else None
                    stream = cut is not None or rng.random() < 0.5
                    jobs.append(pool.submit(one, i, stream, cut))
                for j in jobs:
                    j.result()
                sent += c
                rounds += 1
                if not warm_at and sent >= requests // 5:
                    warm_at.append(time.monotonic() - t0)
                if rounds % 20 == 0:
                    echo(f"soak: {sent}/{requests} requests, {time.monotonic() - t0:.0f} s")
        # Disconnected rows are removed at the server's next step: wait.
        deadline = time.monotonic() + 60
        while True:
            final = suffix.stats()
            if final["active_requests"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        done.set()
        watcher.join()
        rss.append((time.monotonic() - t0, proc.memory_info().rss))
    finally:
        done.set()
        rc = suffix.stop()

    half = [s for s in rss if s[0] >= rss[-1][0] / 2]
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    # RSS at the end of the warm-up: the last sample before it ended.
    warm = [r for t, r in rss if t <= warm_at[0]][-1:] or [rss[0][1]]
    peak = max(r for t, r in rss if t >= warm_at[0]) if warm_at else rss[-1][1]
    rss_growth = mb(max(0, peak - warm[0]))
    result = {
        "model": model,
        "draft_model": draft_model,
        "policy": final["policy"],
        "requests": requests,
        "max_tokens": max_tokens,
        "max_concurrency": max_concurrency,
        "rounds": rounds,
        "distinct_prompts": distinct_prompts,
        **counts,
        "mismatches": mismatches,
        "error_samples": errors[:10],
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(requests / elapsed, 2),
        "active_requests_end": final["active_requests"],
        "bounds": {"max_cached_requests": max_cached_requests,
                   "max_cached_tokens": max_cached_tokens},
        "max_seen": seen,
        "bound_violations": bound_violations[:10],
        "tree_responses_end": final["tree_responses"],
        "cached_requests_end": final["cached_requests"],
        "drafted": final["drafted"],
        "accepted": final["accepted"],
        "source_drafted": counts_by_source(final, "source_drafted"),
        "source_accepted": counts_by_source(final, "source_accepted"),
        "acceptance_rate": round(final["acceptance_rate"], 3),
        "tokens_per_step": round(final["tokens_per_step"], 3),
        "rss_mb": {"first": mb(rss[0][1]), "warm": mb(warm[0]),
                   "middle": mb(rss[len(rss) // 2][1]), "last": mb(rss[-1][1]),
                   "max": mb(max(r for _, r in rss)), "samples": len(rss)},
        "rss_growth_after_warmup_mb": rss_growth,
        "rss_growth_limit_mb": round(rss_growth_limit_mb, 1),
        "rss_slope_second_half_mb_per_min": round(_slope_mb_per_min(half), 3),
        "server_exit_code": rc,
        "log_dir": str(logs),
    }
    result["ok"] = (
        not mismatches
        and counts["errors"] == 0
        and result["active_requests_end"] == 0
        and not bound_violations
        and result["tree_responses_end"] == result["cached_requests_end"]
        and rss_growth <= rss_growth_limit_mb
    )
    echo(
        f"soak: {requests} requests in {result['elapsed_s']} s "
        f"({result['requests_per_s']} req/s, {rounds} rounds, concurrency 1-{max_concurrency}); "
        f"completed {counts['completed']}, disconnected {counts['disconnected']}, "
        f"errors {counts['errors']}, mismatches {len(mismatches)}\n"
        f"soak: active at end {result['active_requests_end']}; max cached "
        f"{seen['cached_requests']}/{max_cached_requests} requests, "
        f"{seen['cached_tokens']}/{max_cached_tokens} tokens, trees {seen['tree_cached']} "
        f"responses ({seen['polls']} polls); "
        f"acceptance {result['acceptance_rate']:.1%}, {result['tokens_per_step']} tokens/step\n"
        f"soak: RSS first {result['rss_mb']['first']} MB, warm {result['rss_mb']['warm']} MB, "
        f"peak {result['rss_mb']['max']} MB, last {result['rss_mb']['last']} MB; growth after "
        f"warm-up {rss_growth}/{result['rss_growth_limit_mb']} MB; slope over the second half "
        f"{result['rss_slope_second_half_mb_per_min']} MB/min\n"
        f"soak: {'OK' if result['ok'] else 'FAILED'}"
    )
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result
