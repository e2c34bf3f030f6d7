"""The suffix cache file: cached responses saved as JSON, read back at
start-up.

Schema (version :data:`CACHE_FILE_VERSION`)::

    {"format": "mlx-lm-suffix-cache", "version": 1, "model": "<model id>",
     "responses": [{"scope": <scope or null>, "tokens": [int, ...]}, ...]}

Saves are atomic (write a temp file in the same folder, fsync, rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, List, Tuple

CACHE_FILE_FORMAT = "mlx-lm-suffix-cache"
CACHE_FILE_VERSION = 1


class CacheFileError(ValueError):
    """A suffix cache file that cannot be used."""


def save_cache_file(drafter: Any, path: str | os.PathLike, model_id: str) -> None:
    """Write ``drafter``'s cached responses to ``path`` atomically."""
    path = Path(path)
    data = {
        "format": CACHE_FILE_FORMAT,
        "version": CACHE_FILE_VERSION,
        "model": model_id,
        "responses": [{"scope": s, "tokens": t} for s, t in drafter.cached_responses()],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_cache_file(path: str | os.PathLike, model_id: str) -> List[Tuple[Any, List[int]]]:
    """Read responses saved by :func:`save_cache_file`.

    Raises ``FileNotFoundError`` when missing, and :class:`CacheFileError`
    when the file is unreadable, corrupt, or was made for another model."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheFileError(f"suffix cache file {path} is not readable: {e}") from e
    if not isinstance(data, dict) or data.get("format") != CACHE_FILE_FORMAT:
        raise CacheFileError(f"{path} is not an mlx-lm-suffix cache file")
    if data.get("version") != CACHE_FILE_VERSION:
        raise CacheFileError(
            f"{path} has cache format version {data.get('version')!r}, "
            f"expected {CACHE_FILE_VERSION}"
        )
    if data.get("model") != model_id:
        raise CacheFileError(
            f"{path} holds token ids of model {data.get('model')!r}, "
            f"not of the loaded model {model_id!r}; use another --suffix-cache-file"
        )
    out = []
    for r in data.get("responses", []):
        tokens = r.get("tokens") if isinstance(r, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise CacheFileError(f"{path} has a malformed response entry")
        out.append((r.get("scope"), tokens))
    return out
