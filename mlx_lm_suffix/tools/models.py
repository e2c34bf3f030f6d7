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

import json
import math
import os
import shutil
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "CACHE_VERSION",
    "CHAT_TEMPLATE",
    "SIZES",
    "SPECIAL_TOKENS",
    "build_model",
    "build_tokenizer",
    "cache_root",
    "ensure_model",
    "get_tokenizer",
    "is_complete",
    "model_config",
]

Arch = Literal["qwen3", "llama"]
Size = Literal["tiny", "small", "bench"]

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
# gains were picked by hand (greedy decoding from a few prompts) so output is
# repetitive but not constant: a smaller gain gives one-token loops, a larger
# one near-uniform noise. Tied embeddings (qwen3) favour repeating the last
# token so need more gain; deeper models (bench) mix more so need less.
_INIT_GAIN = {
    ("qwen3", "tiny"): 0.8,
    ("qwen3", "small"): 0.8,
    ("qwen3", "bench"): 0.7,
    ("llama", "tiny"): 0.6,
    ("llama", "small"): 0.6,
    ("llama", "bench"): 0.7,
}

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


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Root of the cache: ``cache_dir``, else ``$MLX_LM_SUFFIX_HOME``,
    else ``$XDG_CACHE_HOME/mlx_lm_suffix`` (default ``~/.cache/mlx_lm_suffix``).

    Models live in ``<root>/models/``, tokenizers in ``<root>/tokenizers/``.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if home := os.environ.get("MLX_LM_SUFFIX_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "mlx_lm_suffix"


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
    return round(_INIT_GAIN[arch, size] / math.sqrt(SIZES[size]["hidden_size"]), 6)


def model_config(
    arch: Arch = "qwen3",
    size: Size = "tiny",
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    dtype: str = "float32",
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    tie_word_embeddings: bool | None = None,
) -> dict[str, Any]:
    """The ``config.json`` contents for ``arch``/``size``.

    qwen3 ties input/output embeddings by default (like Qwen3-0.6B); llama
    keeps a separate ``lm_head`` (like Llama-3-8B), so both paths get used.
    """
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
        "rope_scaling": None,
        "torch_dtype": dtype,
        "bos_token_id": None,
        # <|im_end|> ends a chat turn, <|endoftext|> ends a document.
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)],
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
    }
    if arch == "qwen3":
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        specific = {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": tie,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    elif arch == "llama":
        tie = False if tie_word_embeddings is None else tie_word_embeddings
        specific = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_traditional": False,
            "tie_word_embeddings": tie,
            "mlp_bias": False,
        }
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen3' or 'llama'")
    specific["initializer_range"] = _init_std(arch, size)
    return dict(sorted({**common, **specific}.items()))


def _model_class(arch: str) -> tuple[type, type]:
    """The mlx-lm ``Model`` and ``ModelArgs`` classes for ``arch``."""
    if arch == "qwen3":
        from mlx_lm.models import qwen3 as module
    elif arch == "llama":
        from mlx_lm.models import llama as module
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen3' or 'llama'")
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
    if arch not in ("qwen3", "llama"):
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen3' or 'llama'")
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
