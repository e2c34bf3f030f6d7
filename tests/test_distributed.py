"""``mlx.launch --backend ring -n 2 ... -- mlx_lm.server --draft suffix``:
two ranks on loopback serve one model (tensor parallel), compared with a
single-process stock server; what it does not support is refused."""

import concurrent.futures
import json
import signal
import time
import urllib.request
from pathlib import Path

import mlx_lm  # noqa: F401  (first: mlx_lm_suffix.policy imports mlx_lm)
import openai
import psutil
import pytest
from openai import OpenAI

from mlx_lm_suffix.persistence import read_cache_file
from mlx_lm_suffix.tools.launcher import ServerError, ServerProcess, distributed_command

MAX_TOKENS = 24
SUFFIX = ("--draft", "suffix")
# Where tests count draft tokens: the adaptive policy's lengths depend on
# timings (outputs never do). The adaptive servers show that every rank
# probes the cost curve and verifies together.
FIXED = (*SUFFIX, "--suffix-policy", "fixed")
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _text(i, n=120):
    import inspect

    src = Path(inspect.getsourcefile(inspect)).read_text()
    return src[30000 + 700 * i : 30000 + 700 * i + n]


def _client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(server, text, **kw):
    r = _client(server).chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        **kw,
    )
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def _stats(server):
    with urllib.request.urlopen(server.url + "/v1/suffix/stats", timeout=60) as r:
        return json.loads(r.read())


def _ranks(server):
    """The rank processes under mlx.launch."""
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "mlx_lm.server" in " ".join(p.cmdline())]


def _still_running(procs, timeout=60):
    """Those of ``procs`` still running after up to ``timeout`` seconds. A
    zombie has exited: its parent (mlx.launch, or init once the launcher is
    gone) has not reaped it yet, which psutil.wait_procs counts as alive."""
    def running(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    alive, deadline = list(procs), time.monotonic() + timeout
    while alive and time.monotonic() < deadline:
        _, alive = psutil.wait_procs(alive, timeout=1)
        alive = [p for p in alive if running(p)]
    return alive


def _serve(model, *args, log, ranks=0):
    """A server of ``model``: one process, or ``ranks`` under mlx.launch."""
    if not ranks:
        return ServerProcess(model, *args, log=log, timeout=300)
    return ServerProcess(model, *args, command=distributed_command(ranks), log=log,
                         timeout=300, process_group=True)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("distributed-logs")


@pytest.fixture(scope="module")
def stock(tiny_model_path, logs):
    with _serve(tiny_model_path, log=logs / "stock.log") as server:
        yield server


@pytest.fixture(scope="module")
def cache_file(logs):
    return logs / "suffix-cache.bin"


@pytest.fixture(scope="module")
def tensor(tiny_model_path, logs, cache_file):
    server = _serve(tiny_model_path, *SUFFIX, "--suffix-cache-file", cache_file,
                    log=logs / "tensor.log", ranks=2)
    yield server
    server.stop()


def test_outputs_equal_single_process_stock_with_eight_concurrent(stock, tensor):
    texts = [_text(i, 80 + 15 * i) for i in range(8)]
    refs = [_chat(stock, t)[:2] for t in texts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda t: _chat(tensor, t), texts))
    assert [o[:2] for o in outs] == refs
    stats = _stats(tensor)
    assert stats["batch"]["max_batch_size"] >= 2, stats["batch"]


@pytest.fixture(scope="module")
def tensor_fixed(tiny_model_path, logs):
    with _serve(tiny_model_path, *FIXED, log=logs / "tensor-fixed.log", ranks=2) as server:
        yield server


def test_repeat_drafts_and_equals_stock(stock, tensor_fixed):
    tensor = tensor_fixed
    text = _text(20, 150)
    ref = _chat(stock, text, max_tokens=40)[:2]
    first = _chat(tensor, text, max_tokens=40)
    second = _chat(tensor, text, max_tokens=40)
    assert first[:2] == ref and second[:2] == ref
    assert second[2].accepted_draft_tokens > 0, (first, second)
    assert second[2].accepted_draft_tokens >= 0.8 * (second[2].completion_tokens - 1)
    # Repeated at once, in one batch (batched verification on both ranks).
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: _chat(tensor, text, max_tokens=40), range(4)))
    assert all(o[:2] == ref for o in outs)
    assert sum(o[2].accepted_draft_tokens for o in outs) > 0
    stats = _stats(tensor)
    assert stats["accepted"] > 0 and stats["batch"]["verify_steps"] > 0


def test_disconnect_leaves_no_rank_stuck(stock, tensor):
    for i, extra in enumerate([{}, {"num_draft_tokens": 0}]):
        stream = _client(tensor).chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": f"bye {i} " + _text(30 + i)}],
            max_tokens=2000, temperature=0, stream=True, extra_body=extra,
        )
        it = iter(stream)
        for _ in range(3):
            next(it)
        stream.close()
    # Both ranks go on generating together: the next answers are stock's.
    texts = [_text(40 + i) for i in range(3)]
    assert [_chat(tensor, t)[:2] for t in texts] == [_chat(stock, t)[:2] for t in texts]
    deadline = time.monotonic() + 60
    while _stats(tensor)["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)  # polling, not synchronisation
    assert _stats(tensor)["active_requests"] == 0


def test_unsupported_combinations_are_clear_errors(tiny_model_path, tensor, logs):
    # seed: stock serves it one request at a time, which a disconnect would hang.
    with pytest.raises(openai.BadRequestError) as e:
        _chat(tensor, "hello", seed=1)
    assert "seed is not supported with --draft suffix" in json.dumps(e.value.body)
    assert _chat(tensor, "still serving")[1] in ("stop", "length")
    # --kv-bits: every request would take that path; no rank starts.
    with pytest.raises(ServerError, match="exited with status"):
        _serve(tiny_model_path, *SUFFIX, "--kv-bits", "8", log=logs / "kv.log", ranks=2)
    assert "--kv-bits is not supported with --draft suffix" in (logs / "kv.log").read_text()


def test_sigterm_stops_every_rank_and_rank_0_saves(tiny_model_path, tensor, cache_file):
    ranks = _ranks(tensor)
    assert len(ranks) == 2
    tensor.send_signal(signal.SIGTERM)
    alive = _still_running(ranks)
    assert not alive, [p.cmdline() for p in alive]
    assert tensor.proc.wait(60) is not None
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_suffix.persistence import model_id

    # Every response served above (rank 0 keeps the cache and its file).
    saved = read_cache_file(cache_file, model_id(str(tiny_model_path), load_tokenizer(tiny_model_path)))
    assert len(saved) >= 8 + 5


def test_ctrl_c_stops_every_rank(tensor_fixed):
    ranks = _ranks(tensor_fixed)
    assert len(ranks) == 2
    tensor_fixed.send_signal(signal.SIGINT)  # Ctrl-C in the terminal
    alive = _still_running(ranks)
    assert not alive, [p.cmdline() for p in alive]


def test_pipeline_is_refused(tiny_family_path, logs):
    # mlx-lm 0.32.2's batched pipeline serving: its ranks can sample
    # different tokens (stock's answers on this model differ from one
    # process's), so a suffix server refuses it, on every rank.
    path = tiny_family_path("qwen3_5")
    with pytest.raises(ServerError, match="exited with status"):
        _serve(path, *SUFFIX, "--pipeline", log=logs / "pipeline.log", ranks=2)
    assert "--pipeline is not supported with --draft suffix" in (logs / "pipeline.log").read_text()
