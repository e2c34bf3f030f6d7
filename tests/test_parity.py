"""Greedy parity, spec-off vs spec-on (mlx_lm_suffix.tools.parity) and its CLI."""

import functools
import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlx_lm_suffix.loop import suffix_generate_step
from mlx_lm_suffix.tools import parity as par
from mlx_lm_suffix.tools.cli import main

MAX_TOKENS = 24


def flip_drafted(prompt, model, drafter, **kwargs):
    """A broken verifier: every drafted token is replaced by the target's
    least likely token."""
    for tok, logprobs, from_draft in suffix_generate_step(prompt, model, drafter, **kwargs):
        if from_draft:
            tok = int(mx.argmin(logprobs).item())
        yield tok, logprobs, from_draft


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return par.load_model(tiny_model_path, "float32")


@pytest.fixture(scope="module")
def prompts():
    builtin = par.builtin_prompts()
    repetitive = [p for p in builtin if p.startswith("Here is a function")]
    # A short text prompt, a highly repetitive one, and raw token ids.
    return [builtin[1], repetitive[0], [5, 6, 7, 8] * 6]


def test_compare_rules():
    top = [{1: -0.1, 2: -0.12, 3: -2.0}]
    assert par.compare([1], top, [1])["status"] == par.EXACT
    near = par.compare([1], top, [2], tie_threshold=0.05)
    assert near["status"] == par.NEAR_TIE
    assert near["divergence"] == 0 and near["gap"] == pytest.approx(0.02)
    assert (near["reference_token"], near["spec_token"]) == (1, 2)
    far = par.compare([1], top, [3], tie_threshold=0.05)
    assert far["status"] == par.FAIL and far["gap"] == pytest.approx(1.9)
    outside = par.compare([1], top, [4])
    assert outside["status"] == par.FAIL and outside["gap"] is None
    shorter = par.compare([1, 1], top * 2, [1])
    assert shorter["status"] == par.FAIL and shorter["divergence"] == 1


def test_builtin_prompts():
    prompts = par.builtin_prompts()
    assert 10 <= len(prompts) <= 20
    assert all(isinstance(p, str) and len(p) > 40 for p in prompts)
    repeated = next(p for p in prompts if p.startswith("Here is a function"))
    body = repeated.split("\n\n", 1)[1]
    assert body.count(body.split("\n")[0]) == 3


def test_parity_exact_on_tiny_model(tiny, prompts):
    model, tokenizer = tiny
    results = par.parity(model, tokenizer, prompts, max_tokens=MAX_TOKENS)
    assert [r["status"] for r in results] == [par.EXACT] * len(prompts)
    assert par.exit_status(results, strict=True) == 0
    for res in results:
        first, repeat = res["runs"]
        assert (first["run"], repeat["run"]) == ("first", "repeat")
        assert first["tokens"] == repeat["tokens"] == res["tokens"]
        # The repeat finds its own first response in the global cache.
        assert repeat["from_draft"] > 0
        assert repeat["accepted"] >= repeat["from_draft"]
    assert "3 prompts: 3 EXACT, 0 NEAR_TIE, 0 FAIL" in par.format_report(results)


def test_parity_fails_with_broken_verifier(tiny, prompts):
    model, tokenizer = tiny
    results = par.parity(model, tokenizer, prompts, max_tokens=MAX_TOKENS, step_fn=flip_drafted)
    assert all(r["status"] == par.FAIL for r in results)
    run = results[0]["runs"][1]
    assert run["divergence"] is not None and run["gap"] is None
    assert par.exit_status(results) == 1
    assert "diverges at" in par.format_report(results)


def test_exit_status_strict():
    near = [{"status": par.NEAR_TIE}]
    assert par.exit_status(near) == 0
    assert par.exit_status(near, strict=True) == 1


def _prompts_file(tmp_path, prompts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def test_cli_parity(tiny_model_path, prompts, tmp_path):
    out = tmp_path / "parity.json"
    args = [
        "parity",
        "--model",
        str(tiny_model_path),
        "--prompts",
        str(_prompts_file(tmp_path, prompts[:2])),
        "--max-tokens",
        "16",
        "--dtype",
        "float32",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 prompts: 2 EXACT" in result.output
    assert [r["status"] for r in json.loads(out.read_text())] == [par.EXACT] * 2


def test_cli_parity_exit_code_on_fail(tiny_model_path, prompts, tmp_path, monkeypatch):
    monkeypatch.setattr(par, "parity", functools.partial(par.parity, step_fn=flip_drafted))
    args = ["parity", "--model", str(tiny_model_path), "--max-tokens", "16"]
    args += ["--prompts", str(_prompts_file(tmp_path, prompts[1:2]))]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "FAIL" in result.output


def test_progress_names_each_prompt_and_run_with_its_tokens(tiny, prompts, monkeypatch):
    # Every run's end is reported with its token count and the time left;
    # with PROGRESS_EVERY 0 every token inside a run is reported too.
    monkeypatch.setattr(par, "PROGRESS_EVERY", 0.0)
    model, tokenizer = tiny
    lines: list = []
    results = par.parity(model, tokenizer, prompts[:2], max_tokens=MAX_TOKENS, report=lines.append)
    ends = [line for line in lines if " tokens in " in line]
    want = []
    for i, res in enumerate(results):
        want.append(f"prompt {i + 1}/2 prefill: {res['prompt_tokens'] - 1} tokens in ")
        want.append(f"prompt {i + 1}/2 spec-off: {res['tokens']} tokens in ")
        want += [f"prompt {i + 1}/2 {r['run']}: {r['tokens']} tokens in " for r in res["runs"]]
    assert [line[: len(w)] for line, w in zip(ends, want, strict=True)] == want
    assert ends[-1].endswith("about 0 s left") and "left" in ends[0]
    during = [line for line in lines if line not in ends]
    assert len(during) == sum(res["tokens"] + sum(r["tokens"] for r in res["runs"]) for res in results)
    assert during[0].startswith("prompt 1/2 spec-off: 1/") and during[0].endswith(" s")


@pytest.mark.parametrize("bits,start", [(4, 0), (8, None)])
def test_parity_with_a_quantized_kv_cache(models_dir, prompts, bits, start):
    """``--kv-bits`` 4 and 8 with ``--quantized-kv-start`` 0 and mlx-lm's
    default reach every run (the mini model: its heads quantize in groups
    of 32); spec-on decoding is EXACT."""
    from mlx_lm_suffix.tools.models import ensure_model

    model, tokenizer = par.load_model(ensure_model("qwen3", "mini", cache_dir=models_dir), "float32")
    kv = dict(kv_bits=bits, kv_group_size=32)
    if start is not None:
        kv["quantized_kv_start"] = start
    results = par.parity(model, tokenizer, prompts, max_tokens=MAX_TOKENS, **kv)
    assert [r["status"] for r in results] == [par.EXACT] * len(prompts)
    assert sum(r["runs"][1]["accepted"] for r in results) > 0
    result = CliRunner().invoke(main, [
        "parity", "--model", str(ensure_model("qwen3", "mini", cache_dir=models_dir)),
        "--max-tokens", "8", "--kv-bits", str(bits), "--kv-group-size", "32",
        *(["--quantized-kv-start", str(start)] if start is not None else []),
    ])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("line,extra,says", [
    ('{"prompt": []}', [], "expected a prompt"),
    ('{"prompt": [1, -2]}', [], "token ids"),
    ('{"prompt": [99999999]}', [], "below"),
    ('{"prompt": "hello there"}', ["--kv-bits", "4"], "group size"),
])
def test_cli_parity_bad_prompts_and_settings_get_one_line(tiny_model_path, tmp_path, line,
                                                          extra, says):
    """An empty prompt, a token id out of the vocabulary, and a KV group size
    the model's head size does not divide (the tiny model's 16 at --kv-bits
    with the default 64) end in one line (tracebacks, or SIGSEGV for the
    id past the vocabulary)."""
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    result = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_path), "--prompts",
                                       str(path), "--max-tokens", "4", *extra])
    assert result.exit_code == 1 and says in result.output, result.output
    assert not isinstance(result.exception, (ValueError, TypeError))
