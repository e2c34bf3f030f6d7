"""The one launcher of ``mlx_lm.server`` subprocesses, for the bench, soak
and demo tools, the tests and ``examples/agent_client.py``.

    with ServerProcess(model, "--draft", "suffix", log="server.log") as server:
        urllib.request.urlopen(server.url + "/v1/models")

The server listens on a free port of 127.0.0.1 and inherits this process's
environment. It is ready once ``/health`` answers 200 and, for a ``--draft
suffix`` server, once its suffix stats list a loaded model.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

from ..patches.serving import STATS_PATH

HOST = "127.0.0.1"
#: The stock server's module (patched by the startup hook as usual).
MLX_LM_SERVER = (sys.executable, "-m", "mlx_lm.server")
#: Seconds a server may take to become ready (loading the model included).
READY_TIMEOUT = 300.0
# Characters of the log quoted in a startup error.
_LOG_TAIL = 4000


def distributed_command(ranks: int = 2, backend: str = "ring", server: Sequence[str] = MLX_LM_SERVER) -> list:
    """``mlx.launch`` running ``server`` (``mlx_lm.server``) on ``ranks`` processes of
    this machine (loopback; mlx-lm shards the model by tensor parallelism,
    or by pipeline with ``--pipeline``). Use with ``process_group=True``:
    mlx.launch passes no signal on, so a stop signals every rank, as Ctrl-C
    in a terminal does."""
    launch = str(Path(sys.executable).with_name("mlx.launch"))
    start = free_ports(ranks)
    return [
        *(launch, "--backend", backend, "-n", str(ranks), "--hosts", HOST),
        *("--starting-port", str(start), "--", *server),
    ]


# Where free_ports looks: below the ephemeral ports that the system hands out
# to outgoing connections (32768 up on Linux, 49152 up on macOS), so that no
# client socket takes one of them between the check and the server's binds.
_PORTS = range(20000, 32768)


def free_ports(count: int = 1, tries: int = 200) -> int:
    """The first of ``count`` consecutive TCP ports of 127.0.0.1 that are
    all free now (a server binds them moments later; mlx.launch's ring
    gives rank ``i`` ``--starting-port`` plus ``i``). Raises ``OSError``
    if ``tries`` random runs all had one taken."""
    for _ in range(tries):
        start = random.randrange(_PORTS.start, _PORTS.stop - count + 1)
        with contextlib.ExitStack() as held:
            try:
                for port in range(start, start + count):
                    held.enter_context(socket.socket()).bind((HOST, port))
            except OSError:
                continue
        return start
    raise OSError(f"no {count} consecutive free ports in {_PORTS} after {tries} tries")


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """Around starting a server: Ctrl-C must reach it even where this
    process has SIGINT ignored (a background job of a non-interactive
    shell), which a child inherits; a handled signal is reset to its
    default by exec, so the parent handles it meanwhile. (Not a preexec_fn:
    running Python between fork and exec can deadlock a process with other
    threads, as MLX's.) Only the main thread can change it."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if not ignored or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class ServerError(RuntimeError):
    """The server exited or was not ready in time; the message ends with the
    tail of its log."""


class ServerProcess:
    """``command --model MODEL --host 127.0.0.1 --port PORT *args`` in a
    subprocess, on a free port; ``url`` is its base URL, ``proc`` the process.

    ``env`` adds to (or overrides) this process's environment. The server's
    output goes to the file ``log`` (truncated, or appended to with
    ``append_log``), else to an anonymous temporary file; :meth:`log` reads
    it. With ``wait`` the constructor returns once the server is ready
    (:meth:`wait_ready`, at most ``timeout`` seconds); if it is not, the
    server is stopped and :class:`ServerError` raised. As a context manager
    it stops the server on exit (:meth:`stop`). ``process_group``: the
    command runs in a process group of its own, which :meth:`stop` signals
    (every rank of :func:`distributed_command`).
    """

    def __init__(
        self,
        model: Union[str, os.PathLike],
        *args: Any,
        command: Sequence[str] = MLX_LM_SERVER,
        env: Optional[Mapping[str, str]] = None,
        log: Optional[Union[str, os.PathLike]] = None,
        append_log: bool = False,
        wait: bool = True,
        timeout: float = READY_TIMEOUT,
        process_group: bool = False,
    ):
        args = [str(a) for a in args]
        self.port = free_ports()
        self.url = f"http://{HOST}:{self.port}"
        self._suffix = "--draft" in args
        self.log_path = Path(log) if log is not None else None
        if self.log_path is None:
            self._log = tempfile.TemporaryFile()
        else:
            self._log = open(self.log_path, "ab" if append_log else "wb")
        self._log_start = self._log.tell()  # this server's part of the file
        self.command = [*command, "--model", str(model), "--host", HOST, "--port", str(self.port), *args]
        try:
            with _sigint_not_ignored():
                self.proc = subprocess.Popen(
                    self.command,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    start_new_session=process_group,
                )
            self._group = process_group
        except BaseException:
            self._log.close()
            raise
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log(self) -> str:
        """What the server has written so far (to a file ``log``: also after
        :meth:`stop`; to the temporary file: until then)."""
        if self.log_path is not None:
            data = self.log_path.read_bytes()[self._log_start :]
        elif self._log.closed:
            return ""
        else:  # pread: the server shares the file's offset
            fd = self._log.fileno()
            data = os.pread(fd, os.fstat(fd).st_size - self._log_start, self._log_start)
        return data.decode("utf-8", "replace")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status != 200:
                    return False
            if not self._suffix:
                return True
            with urllib.request.urlopen(self.url + STATS_PATH, timeout=2) as r:
                return bool(json.loads(r.read())["models"])  # the model has loaded
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Return once the server answers (see the module doc); raise
        :class:`ServerError` if it exits first or is not ready within
        ``timeout`` seconds (the server is left running then)."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                self._fail(f"server exited with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                self._fail(f"server not ready within {timeout:g} s")
            time.sleep(0.05)  # polling interval, not synchronisation
        if self._group:
            # mlx.launch (mlx 0.32) polls its ranks' pipes without blocking;
            # the ranks started at the default priority, it yields to them now.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, 19)

    def send_signal(self, sig: int) -> None:
        """Signal the server (with ``process_group``: every process of it)."""
        if self._group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def _fail(self, what: str) -> None:
        where = f" (log: {self.log_path})" if self.log_path else ""
        tail = self.log()[-_LOG_TAIL:]
        raise ServerError(f"{what}: {' '.join(self.command)}{where}\n--- log tail ---\n{tail}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` if the server still runs, wait up to ``timeout``
        seconds, then kill it and wait as long again; close the log. Returns
        the exit status (negative: the signal that ended it). Idempotent."""
        if self.proc.poll() is None:
            self.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.proc.wait(timeout)
        if self._group:
            self.send_signal(signal.SIGKILL)  # ranks left after mlx.launch (none, normally)
        self._log.close()
        return self.proc.returncode
