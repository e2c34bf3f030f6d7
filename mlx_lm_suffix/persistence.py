"""The suffix cache file: cached responses saved as JSON, read back at
start-up.

Schema (version :data:`CACHE_FILE_VERSION`)::

    {"format": "mlx-lm-suffix-cache", "version": 2, "model": "<model id>",
     "responses": [{"scope": <scope or null>, "tokens": "<base64>"}, ...]}

``scope`` is null (the global scope) or a string; ``tokens`` is the base64
of the response's token ids as little-endian int32 (version 1, also read:
a list of ints), each an id of the model's vocabulary. Saves are atomic
(write a temp file in the same folder, fsync, rename).

:class:`CacheFile` is the file of one ``mlx_lm.server --draft suffix
--suffix-cache-file PATH``: read at start-up, saved in the background, on
SIGTERM and at shutdown, never replaced by another model's responses. Any
other file that is not a valid one gives one warning and an empty cache,
and is left as it is until a save of new responses replaces it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

CACHE_FILE_FORMAT = "mlx-lm-suffix-cache"
CACHE_FILE_VERSION = 2
# Versions read: 1 (tokens as lists of ints) and 2.
_READ_VERSIONS = (1, 2)
# Token ids as saved (version 2); the suffix trees take int32 ids.
_TOKEN_DTYPE = np.dtype("<i4")
_MAX_TOKEN_ID = 2**31 - 1
#: Least time between two background saves of a :class:`CacheFile`.
SAVE_INTERVAL_S = float(os.environ.get("MLX_LM_SUFFIX_SAVE_INTERVAL", "5"))

logger = logging.getLogger("mlx_lm_suffix.serving")


class CacheFileError(ValueError):
    """A suffix cache file that cannot be used."""


class OtherModelError(CacheFileError):
    """A suffix cache file made for another model (its id: ``model``)."""

    def __init__(self, message: str, model: str):
        super().__init__(message)
        self.model = model


class CacheFileRefused(RuntimeError):
    """The cache file holds token ids of another model: a server must not
    use or overwrite it."""


def model_id(model_path: str, tokenizer: Any) -> str:
    """Identify the token ids of a model: its path (resolved) or repo id,
    plus the vocabulary size and a hash of the vocabulary."""
    path = Path(model_path).expanduser()
    name = str(path.resolve()) if path.exists() else str(model_path)
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return f"{name}|vocab={len(vocab)}|sha256={h.hexdigest()[:16]}"


def vocabulary_size(model: Any, tokenizer: Any) -> int:
    """How many token ids ``model`` embeds: its ``vocab_size`` (or its text
    config's), else the size of ``tokenizer``'s vocabulary."""
    args = getattr(model, "args", None)
    n = getattr(args, "vocab_size", None)
    if not isinstance(n, int):
        text = getattr(args, "text_config", None)
        n = text.get("vocab_size") if isinstance(text, dict) else None
    return n if isinstance(n, int) and n > 0 else len(tokenizer.get_vocab())


def save_cache_file(drafter: Any, path: str | os.PathLike, model_id: str) -> None:
    """Write ``drafter``'s cached responses to ``path`` atomically.

    The responses are taken under the drafter's lock without copying them,
    and encoded after it, one at a time (so generation is not held up for
    long: a save of 4M tokens holds the GIL for microseconds at a time)."""
    path = Path(path)
    responses = drafter.cached_responses()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(
                f'{{"format":{json.dumps(CACHE_FILE_FORMAT)},"version":{CACHE_FILE_VERSION},'
                f'"model":{json.dumps(model_id)},"responses":['
            )
            for i, (scope, tokens) in enumerate(responses):
                packed = np.asarray(tokens, dtype=_TOKEN_DTYPE).tobytes()
                entry = json.dumps({"scope": scope, "tokens": base64.b64encode(packed).decode()})
                f.write("," + entry if i else entry)
            f.write("]}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _tokens(saved: Any, version: int) -> Optional[List[int]]:
    """The token ids of a saved response (None: not valid ones)."""
    if version == 1:
        valid = isinstance(saved, list) and (
            not saved
            or (set(map(type, saved)) == {int} and 0 <= min(saved) and max(saved) <= _MAX_TOKEN_ID)
        )
        return saved if valid else None
    if not isinstance(saved, str):
        return None
    try:
        packed = base64.b64decode(saved, validate=True)
    except binascii.Error:
        return None
    if len(packed) % _TOKEN_DTYPE.itemsize:
        return None
    tokens = np.frombuffer(packed, dtype=_TOKEN_DTYPE)
    return tokens.tolist() if not tokens.size or tokens.min() >= 0 else None


def read_cache_file(
    path: str | os.PathLike, model_id: str, vocab_size: Optional[int] = None
) -> List[Tuple[Any, List[int]]]:
    """Read responses saved by :func:`save_cache_file`: ``(scope, tokens)``
    pairs, each token in ``[0, vocab_size)`` when ``vocab_size`` is given.

    Raises ``FileNotFoundError`` when missing, :class:`OtherModelError` when
    it was made for another model (whatever its version), and
    :class:`CacheFileError` for anything else that is not a valid file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        # ValueError: invalid JSON or UTF-8, or an integer of too many digits.
        raise CacheFileError(
            f"suffix cache file {path} is not readable: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(data, dict) or data.get("format") != CACHE_FILE_FORMAT:
        raise CacheFileError(f"{path} is not an mlx-lm-suffix cache file")
    stored = data.get("model")
    if stored != model_id:
        message = (
            f"{path} holds token ids of model {stored!r}, "
            f"not of the loaded model {model_id!r}; use another --suffix-cache-file"
        )
        if isinstance(stored, str):
            raise OtherModelError(message, stored)
        raise CacheFileError(message)
    version = data.get("version")
    if version not in _READ_VERSIONS or isinstance(version, bool):
        raise CacheFileError(
            f"{path} has cache format version {version!r}, expected one of {_READ_VERSIONS}"
        )
    responses = data.get("responses")
    if not isinstance(responses, list):
        raise CacheFileError(f"{path}: 'responses' is not a list")
    out = []
    for i, r in enumerate(responses):
        tokens = _tokens(r.get("tokens"), version) if isinstance(r, dict) else None
        if tokens is None:
            raise CacheFileError(f"{path}: response {i} has no valid token ids")
        scope = r.get("scope")
        if scope is not None and not isinstance(scope, str):
            raise CacheFileError(f"{path}: response {i} has a scope that is not a string")
        out.append((scope, tokens))
    if vocab_size is not None:
        check_vocabulary(path, out, vocab_size)
    return out


def check_vocabulary(
    path: str | os.PathLike, responses: List[Tuple[Any, List[int]]], vocab_size: int
) -> None:
    """Raise :class:`CacheFileError` when a token of ``responses`` (read
    from ``path``) is not below ``vocab_size``."""
    for i, (_, tokens) in enumerate(responses):
        if tokens and max(tokens) >= vocab_size:
            raise CacheFileError(
                f"{path}: response {i} has token id {max(tokens)}, past the "
                f"model's vocabulary of {vocab_size}"
            )


class CacheFile:
    """The ``--suffix-cache-file`` of one server.

    The file belongs to one model: the server's ``--model``, checked at
    start-up (:meth:`check_at_start`), or else the first model loaded. That
    model's drafter is warmed from the file (:meth:`attach`) and saved to it
    (:meth:`save`), in the background while :meth:`saving` runs and once
    more when it ends. A file made for another model is neither used nor
    overwritten. Thread-safe.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self._lock = threading.RLock()
        self._checked = False
        self._model: Optional[str] = None  # the model id the file belongs to
        self._responses: List[Tuple[Any, List[int]]] = []  # read, not yet in a drafter
        self._disabled = False  # another model's file
        self._drafter: Any = None  # the drafter saved to the file
        self._saved: Any = None  # its signature when last saved
        self._stop = threading.Event()

    def check_at_start(self, model_path: str) -> None:
        """Read the file for the model at ``model_path`` (the server's
        default model, in the main thread before serving). Raises
        :class:`CacheFileRefused` when the file belongs to another model."""
        try:
            from mlx_lm.utils import load_tokenizer

            mid = model_id(model_path, load_tokenizer(model_path))
        except Exception as e:  # resolved later, when the model loads
            logger.info("mlx-lm-suffix: cache file check deferred to model load (%s)", e)
            return
        with self._lock:
            self._read(mid, refuse=True)

    def _read(self, expected: str, refuse: bool) -> None:
        self._checked = True
        path = self.path
        try:
            self._responses = read_cache_file(path, expected)
            self._model = expected
            logger.info("mlx-lm-suffix: loaded %d responses from %s", len(self._responses), path)
            return
        except FileNotFoundError:
            logger.info("mlx-lm-suffix: %s does not exist yet; starting with an empty cache", path)
        except OtherModelError as e:
            msg = (
                f"suffix cache file {path} was made for model {e.model!r}, not for "
                f"the loaded model {expected!r}: refusing to use or overwrite it. "
                "Pass another --suffix-cache-file (or delete this one)."
            )
            if refuse:
                raise CacheFileRefused(msg) from e
            logger.error("mlx-lm-suffix: %s", msg)
            self._disabled = True
            return
        except CacheFileError as e:
            self._warn(e)
        self._model = expected

    def _warn(self, error: CacheFileError) -> None:
        logger.warning(
            "mlx-lm-suffix: %s; starting with an empty suffix cache (the file is "
            "left as it is until new responses are saved to it)",
            error,
        )

    def attach(self, model_id: str, drafter: Any, vocab_size: Optional[int] = None) -> bool:
        """A model was loaded: warm its ``drafter`` (None: it cannot draft)
        from the file if the file belongs to it and every token id is below
        ``vocab_size``. Returns whether the file saves this drafter."""
        with self._lock:
            if not self._disabled and self._drafter is None:
                if not self._checked:
                    # No --model: the first model loaded claims the file.
                    self._read(model_id, refuse=False)
                if not self._disabled and model_id == self._model and drafter is not None:
                    if vocab_size is not None:
                        try:
                            check_vocabulary(self.path, self._responses, vocab_size)
                        except CacheFileError as e:
                            self._warn(e)
                            self._responses = []
                    n = drafter.add_responses(self._responses)
                    self._responses = []
                    self._drafter = drafter
                    self._saved = _signature(drafter)
                    if n:
                        logger.info("mlx-lm-suffix: warmed the suffix cache with %d responses", n)
            return drafter is not None and self._drafter is drafter

    def save(self, force: bool = False) -> bool:
        """Save the drafter's cache atomically if it changed since the last
        save (``force``: anyway). Returns whether it saved."""
        with self._lock:
            drafter = self._drafter
            if drafter is None:
                return False
            sig = _signature(drafter)
            if not force and sig == self._saved:
                return False
            try:
                save_cache_file(drafter, self.path, self._model)
            except OSError as e:
                logger.error("mlx-lm-suffix: could not save %s: %s", self.path, e)
                return False
            self._saved = sig
            return True

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Save at most every :data:`SAVE_INTERVAL_S` seconds in a
        background thread while the block runs, and once more after it."""
        saver = threading.Thread(target=self._save_loop, name="mlx-lm-suffix-saver", daemon=True)
        saver.start()
        try:
            yield
        finally:
            self._stop.set()
            saver.join()
            self.save()

    def _save_loop(self) -> None:
        while not self._stop.wait(SAVE_INTERVAL_S):
            try:
                self.save()
            except Exception:  # never let the saver die silently mid-run
                logger.exception("mlx-lm-suffix: saving the suffix cache failed")


def _signature(drafter: Any) -> Tuple[int, int, int]:
    """Changes when the drafter's cached responses do."""
    return (
        drafter.stats.requests - drafter.active_requests,
        drafter.cached_requests,
        drafter.cached_tokens,
    )
