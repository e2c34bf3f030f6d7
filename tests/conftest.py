"""Shared fixtures: tiny random-weight models built locally, saved to a
folder and loaded through the real ``mlx_lm.load``."""

import os
import selectors
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """Cache root for built models: $MLX_LM_SUFFIX_HOME (reused across runs,
    the Makefile sets it) or a fresh temporary folder."""
    home = os.environ.get("MLX_LM_SUFFIX_HOME")
    return Path(home) if home else tmp_path_factory.mktemp("mlx_lm_suffix")


@pytest.fixture(scope="session")
def tiny_model_path(models_dir) -> Path:
    from mlx_lm_suffix.tools.models import ensure_model

    return ensure_model("qwen3", "tiny", cache_dir=models_dir)


@pytest.fixture(scope="session")
def tiny_llama_path(models_dir) -> Path:
    from mlx_lm_suffix.tools.models import ensure_model

    return ensure_model("llama", "tiny", cache_dir=models_dir)


@pytest.fixture(scope="session")
def tiny_family_path(models_dir):
    """``family -> path``: the tiny random-weight model of any family in
    ``mlx_lm_suffix.tools.models.FAMILIES``, built on first use."""
    from mlx_lm_suffix.tools.models import ensure_model

    return lambda family: ensure_model(family, "tiny", cache_dir=models_dir)


def _connections_taken(server, n: int = 40, timeout: float = 1.5) -> int:
    """How many of ``n`` connections opened at once a server subprocess's
    listen queue takes while it accepts none (the process stopped): the
    others' handshakes wait for a SYN retransmit."""
    u = urlsplit(server.url)
    socks, sel = [], selectors.DefaultSelector()
    server.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((u.hostname, u.port))
            sel.register(s, selectors.EVENT_WRITE)
            socks.append(s)
        connected, deadline = set(), time.monotonic() + timeout
        while len(connected) < n and time.monotonic() < deadline:
            for key, _ in sel.select(deadline - time.monotonic()):
                if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    connected.add(key.fileobj)
                sel.unregister(key.fileobj)
        return len(connected)
    finally:
        sel.close()
        for s in socks:
            s.close()
        server.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def connections_taken():
    """:func:`_connections_taken` (POSIX: it stops the server process)."""
    if not hasattr(signal, "SIGSTOP"):
        pytest.skip("needs SIGSTOP")
    return _connections_taken
