"""``--suffix-cache-file`` contents a server must survive: every malformed
file gives one warning naming it, an empty cache, and is left as it was
until a save of new responses replaces it (``CacheFile``, the server's
loader; through a real server in ``tests/test_server.py``)."""

import base64
import json
import logging

import numpy as np
import pytest

from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.persistence import CacheFile, read_cache_file, save_cache_file

MODEL = "model-a"
VOCAB = 2048


def _file(responses, version=1) -> str:
    return json.dumps({"format": "mlx-lm-suffix-cache", "version": version, "model": MODEL,
                       "responses": responses})


def _ok(tokens=(5, 6, 7), scope=None):
    """A version 1 response."""
    return {"scope": scope, "tokens": list(tokens)}


def _packed(tokens, dtype="<i4"):
    """Tokens as version 2 saves them (with another ``dtype``: not as it does)."""
    return base64.b64encode(np.asarray(tokens, dtype=dtype).tobytes()).decode()


def _ok2(tokens=(5, 6, 7), scope=None):
    return {"scope": scope, "tokens": _packed(tokens)}


# name -> file contents (text)
MALFORMED = {
    "responses null": _file(None),
    "responses a number": _file(7),
    "responses missing": _file([])[: -len(', "responses": []}')] + "}",
    "response not an object": _file([_ok(), [1, 2]]),
    "tokens not a list": _file([{"scope": None, "tokens": "1 2"}]),
    "a 5000-digit token": _file([_ok()])[:-4] + ", " + "9" * 5000 + "]}]}",
    "100000-deep nesting": _file([_ok()])[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "scope a list": _file([_ok(), _ok(scope=["alice"])]),
    "scope an object": _file([_ok(scope={"a": 1})]),
    "token id 2**40": _file([_ok(), _ok((1, 2**40))]),
    "token id past the vocabulary": _file([_ok(), _ok((1, VOCAB))]),
    "token id 10**6": _file([_ok((10**6,))]),
    "negative token": _file([_ok((-1,))]),
    "float token": _file([_ok((1.0,))]),
    "bool token": _file([_ok((True,))]),
    "truncated": _file([_ok()] * 3)[:40],
    "not JSON": "{nope",
    "not UTF-8": b"\xff\xfe{}".decode("latin-1"),
    "junk array": json.dumps(list(range(100_000))),
    "empty": "",
    "version 3": _file([_ok()], version=3),
    "version true": _file([_ok()], version=True),
    "v2 tokens a list": _file([_ok2(), _ok()], version=2),
    "v2 tokens not base64": _file([_ok2(), {"scope": None, "tokens": "!!"}], version=2),
    "v2 tokens not int32": _file([_ok2(), {"scope": None, "tokens": _packed([1], "<i2")}], 2),
    "v2 negative token": _file([_ok2(), _ok2((1, -5))], version=2),
    "v2 token past the vocabulary": _file([_ok2(), _ok2((VOCAB + 1,))], version=2),
    "v2 scope a list": _file([_ok2(), _ok2(scope=[1])], version=2),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_file_warns_once_and_starts_empty(tmp_path, caplog, name):
    path = tmp_path / "cache.json"
    path.write_bytes(MALFORMED[name].encode("latin-1" if name == "not UTF-8" else "utf-8"))
    before = path.read_bytes()
    cache_file = CacheFile(path)
    drafter = SuffixDrafter()
    with caplog.at_level(logging.WARNING, logger="mlx_lm_suffix.serving"):
        assert cache_file.attach(MODEL, drafter, VOCAB)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), warnings
    assert drafter.cached_requests == 0
    # Left as it was: nothing new to save.
    assert not cache_file.save()
    assert path.read_bytes() == before
    # A good save replaces it.
    drafter.finish(drafter.start([1, 2, 3]))
    assert cache_file.save()
    assert read_cache_file(path, MODEL, VOCAB) == [(None, [1, 2, 3])]


@pytest.mark.parametrize("version", [1, 2])
def test_valid_file_warms_the_drafter(tmp_path, caplog, version):
    """The control: the same loader takes the largest valid ids and scopes,
    from files of both versions."""
    ok = _ok if version == 1 else _ok2
    path = tmp_path / "cache.json"
    path.write_text(_file([ok((0, VOCAB - 1)), ok(scope="user:x"), ok(())], version))
    drafter = SuffixDrafter()
    with caplog.at_level(logging.WARNING, logger="mlx_lm_suffix.serving"):
        assert CacheFile(path).attach(MODEL, drafter, VOCAB)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert drafter.cached_requests == 3
    assert drafter.cached_responses() == [(None, [0, VOCAB - 1]), ("user:x", [5, 6, 7]),
                                          (None, [])]


def test_save_reads_back(tmp_path):
    drafter = SuffixDrafter()
    drafter.add_responses([(None, [1, 2, 3]), ("user:x", list(range(2000))), (None, [])])
    path = tmp_path / "cache.json"
    save_cache_file(drafter, path, MODEL)
    data = json.loads(path.read_text())
    assert data["version"] == 2
    assert data["responses"][1] == {"scope": "user:x", "tokens": _packed(range(2000))}
    assert len(path.read_bytes()) < 4 * 2003 * 1.4 + 300  # base64 of int32s, and the rest
    assert read_cache_file(path, MODEL, VOCAB) == drafter.cached_responses()
