"""What a ``--draft suffix`` server tells its operator: Prometheus metrics
(``GET /metrics``, written by ``prometheus_client``) and a periodic
``SpecDecoding metrics`` log line, both in vLLM's terms.

- Speculative decoding, per model and draft source (``tree``, ``copy``),
  with vLLM's names and meanings under this plugin's prefix:
  ``mlx_lm_suffix_spec_decode_num_drafts_total`` (drafts verified),
  ``..._num_draft_tokens_total`` (their tokens), ``..._num_accepted_tokens_total``,
  and ``..._num_accepted_tokens_per_pos_total`` (label ``position``, 0 the
  first draft token: drafts whose token there was accepted). Acceptance
  rate is accepted / draft tokens, mean acceptance length
  1 + accepted / drafts.
- The plugin's own: drafts refused for cost, replays, forwards and tokens,
  cache occupancy (requests active and cached, tokens cached).
- Requests, per model: histograms of time to first token, time per output
  token (a request's mean after its first) and request time, prompt and
  generated tokens, requests by finish reason; and every completion POST by
  endpoint and HTTP status.

All counters are read from the drafters (:meth:`SuffixDrafter.snapshot`)
and the requests the server answered, per server (a registry of its own,
never the process-wide default one).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger("mlx_lm_suffix.metrics")

PREFIX = "mlx_lm_suffix"
METRICS_PATH = "/metrics"
#: The completion endpoints of mlx-lm 0.32.2's server (other paths: "other").
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
#: How requests that began generating ended: mlx-lm's finish reasons, an
#: error answered to the client, or the client gone before the end.
FINISH_REASONS = ("stop", "length", "error", "abort")
#: Most draft positions the log line shows.
LOG_POSITIONS = 8

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


#: Each loaded model's name and its drafter's snapshot
#: (:meth:`~mlx_lm_suffix.drafter.SuffixDrafter.snapshot`).
Snapshots = Callable[[], List[Tuple[str, Dict[str, Any]]]]


class ServerMetrics:
    """The metrics of one suffix server: its ``settings`` (policy, scope,
    num_draft_tokens), its drafters' counts (``snapshots``), and what its
    handlers observe.

    ``registry`` holds them all: the operator's. ``public`` is what
    ``GET /metrics`` answers to anyone: all of them where ``shared`` (the
    ``global`` cache scope, where every request drafts from every other's
    answers anyway), else only :data:`PREFIX` ``_info`` (the settings):
    every other metric counts all callers' traffic.
    """

    def __init__(self, settings: Dict[str, str], shared: bool, snapshots: Snapshots):
        self.snapshots = snapshots
        self.registry = CollectorRegistry()
        info = dict(settings)
        Info(PREFIX, "Settings of this mlx-lm-suffix server", registry=self.registry).info(info)
        if shared:
            self.public = self.registry
        else:
            self.public = CollectorRegistry()
            Info(PREFIX, "Settings of this mlx-lm-suffix server", registry=self.public).info(info)
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from a request's arrival to its first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "A request's mean time per output token after its first",
                              ["model"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from a request's arrival to its answer's end",
                             ["model"], buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of requests",
                                     ["model"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Tokens generated for requests", ["model"], registry=r)
        self.requests = Counter(f"{PREFIX}_requests",
                                "Requests that began generating, by how they ended",
                                ["model", "finish_reason"], registry=r)
        self.http = Counter(f"{PREFIX}_http_requests", "Completion requests by HTTP status",
                            ["endpoint", "status"], registry=r)
        r.register(_DrafterCollector(snapshots))

    def exposition(self, accept: Optional[str], public: bool = True) -> Tuple[bytes, str]:
        """The body and content type of a scrape (``accept``: the request's
        Accept header: Prometheus text, or OpenMetrics where asked for)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.public if public else self.registry), content_type

    def observe(self, endpoint: str, status: Optional[int], info: Any,
                started: float, outcome: Optional[str]) -> None:
        """A completion POST was answered with HTTP ``status`` (None: none
        sent), ``started`` (``time.perf_counter()``) when its handler began.
        ``info``: the request's record (``serving.RequestRecord``), whose
        ``model`` is set once it began generating; ``outcome``: "error" or "abort" where an
        exception ended its answer."""
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        self.http.labels(endpoint, str(status) if status is not None else "none").inc()
        if info is None or info.model is None:
            return
        model = info.model
        reason = outcome or info.finish_reason or "error"
        self.requests.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(info.prompt_tokens)
        self.generation_tokens.labels(model).inc(info.tokens)
        self.e2e.labels(model).observe(time.perf_counter() - started)
        if info.first_token_at is not None:
            self.ttft.labels(model).observe(info.first_token_at - started)
            if info.tokens > 1:
                mean = (info.last_token_at - info.first_token_at) / (info.tokens - 1)
                self.tpot.labels(model).observe(mean)

    @contextlib.contextmanager
    def logging(self, interval: float) -> Iterator[None]:
        """While it lasts, log :func:`log_line` every ``interval`` seconds
        for each model that stepped meanwhile (0: never)."""
        if interval <= 0:
            yield
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._log_every, args=(interval, stop),
                                  name="mlx-lm-suffix-metrics-log", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(interval + 5)

    def _log_every(self, interval: float, stop: threading.Event) -> None:
        last: Dict[str, Dict[str, Any]] = {}
        then = time.monotonic()
        while not stop.wait(interval):
            now = time.monotonic()
            for name, snap in self.snapshots():
                # (A model loaded since the last line counts from zero.)
                line = log_line(last.get(name, _NOTHING), snap, now - then)
                if line is not None:
                    logger.info("%s, Model: %s", line, name)
                last[name] = snap
            then = now

    @contextlib.contextmanager
    def listening(self, host: Optional[str], port: Optional[int]) -> Iterator[None]:
        """While it lasts, serve every metric (:attr:`registry`) on
        ``host:port`` as well, where ``port`` is given (the operator's
        scrape address, for a server whose ``/metrics`` hides traffic)."""
        if not port:
            yield
            return
        from prometheus_client import start_http_server

        server, thread = start_http_server(port, addr=host or "127.0.0.1", registry=self.registry)
        logger.info("mlx-lm-suffix: metrics on http://%s:%d%s", host, port, METRICS_PATH)
        try:
            yield
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)


class _DrafterCollector:
    """The drafters' counters, read at each scrape."""

    #: Snapshot key -> (metric name, help), per draft source.
    BY_SOURCE = {
        "source_drafts": ("spec_decode_num_drafts", "Drafts verified"),
        "source_drafted": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
        "source_accepted": ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
    }
    COUNTERS = {
        "refused": ("spec_decode_refused_drafts",
                    "Drafts not verified because verifying them would not pay"),
        "replays": ("replays", "Verifications after which a request's state was restored "
                    "and its kept tokens fed again"),
        "steps": ("decode_steps", "Forwards of the target model that emitted tokens"),
        "tokens": ("decode_tokens", "Tokens emitted"),
        "evictions": ("cache_evictions", "Earlier responses the global cache dropped for its bounds"),
    }
    GAUGES = {
        "active_requests": ("cache_active_requests", "Requests in flight in the suffix trees"),
        "cached_requests": ("cache_requests", "Earlier responses in the global cache"),
        "cached_tokens": ("cache_tokens", "Tokens of earlier responses in the global cache"),
    }

    def __init__(self, snapshots: Snapshots):
        self.snapshots = snapshots

    def collect(self) -> Iterator[Any]:
        by_source = {k: CounterMetricFamily(f"{PREFIX}_{n}", h, labels=["model", "source"])
                     for k, (n, h) in self.BY_SOURCE.items()}
        per_position = CounterMetricFamily(
            f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at a position (0: the first) was accepted",
            labels=["model", "position"])
        counters = {k: CounterMetricFamily(f"{PREFIX}_{n}", h, labels=["model"])
                    for k, (n, h) in self.COUNTERS.items()}
        gauges = {k: GaugeMetricFamily(f"{PREFIX}_{n}", h, labels=["model"])
                  for k, (n, h) in self.GAUGES.items()}
        for name, snap in self.snapshots():
            for key, family in by_source.items():
                for source, n in snap[key].items():
                    family.add_metric([name, source], n)
            for position, n in snap["accepted_per_position"].items():
                per_position.add_metric([name, position], n)
            for key, family in {**counters, **gauges}.items():
                family.add_metric([name], snap[key])
        yield from by_source.values()
        yield per_position
        yield from counters.values()
        yield from gauges.values()


def samples(text: str) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """A scrape's samples (Prometheus text, read by prometheus_client's
    parser): value by sample name and sorted label items."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(scrape: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    """The sum of the :func:`samples` named ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= set(ls))


#: The counters :func:`log_line` reads, of a drafter that has done nothing.
_NOTHING: Dict[str, Any] = {"steps": 0, "accepted": 0, "drafted": 0, "refused": 0,
                            "source_drafts": {}, "accepted_per_position": {}}


def log_line(before: Dict[str, Any], after: Dict[str, Any], seconds: float) -> Optional[str]:
    """vLLM's ``SpecDecoding metrics`` line over the interval between two
    drafter snapshots ``seconds`` apart, with the drafts refused for cost;
    None where no forward ran in it."""
    if after["steps"] <= before["steps"]:
        return None

    def delta(key: str) -> float:
        return after[key] - before[key]

    def delta_of(key: str, k: str) -> float:
        return after[key].get(k, 0) - before[key].get(k, 0)

    drafts = sum(after["source_drafts"].values()) - sum(before["source_drafts"].values())
    accepted, drafted = delta("accepted"), delta("drafted")
    mean_length = 1 + accepted / drafts if drafts else 1.0
    rates = [delta_of("accepted_per_position", str(i)) / drafts if drafts else 0.0
             for i in range(LOG_POSITIONS)]
    while rates and rates[-1] == 0:
        rates.pop()
    per_position = ", ".join(f"{r:.3f}" for r in rates) or "-"
    return (
        f"SpecDecoding metrics: Mean acceptance length: {mean_length:.2f}, "
        f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
        f"Drafted throughput: {drafted / seconds:.2f} tokens/s, "
        f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
        f"Per-position acceptance rate: {per_position}, "
        f"Refused drafts: {delta('refused')}"
    )
