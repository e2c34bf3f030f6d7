"""The server launcher (mlx_lm_suffix.tools.launcher) on stand-in servers:
readiness, failures quoting the log, logs, environment and stopping. The
real ``mlx_lm.server`` goes through it in test_server.py and the tools'
tests."""

import signal
import socket
import sys
import textwrap

import pytest

from mlx_lm_suffix.tools import launcher
from mlx_lm_suffix.tools.launcher import ServerError, ServerProcess

# Serves /health (200) on the --port it is given; prints its argv and $GREETING.
HEALTH = textwrap.dedent(
    """
    import http.server, os, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("argv", sys.argv[1:], "greeting", os.environ.get("GREETING"), flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def stand_in(code):
    return (sys.executable, "-c", code)


def test_ready_server_gets_args_env_and_stops(tmp_path):
    log = tmp_path / "server.log"
    with ServerProcess("m", "--flag", 3, command=stand_in(HEALTH), env={"GREETING": "hi"},
                       log=log, timeout=60) as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.proc.poll() is None
        out = server.log()
        assert "'--model', 'm', '--host', '127.0.0.1'" in out and "'--flag', '3'" in out
        assert "greeting hi" in out
    assert server.proc.returncode == -signal.SIGTERM
    assert server.stop() == -signal.SIGTERM  # idempotent
    assert "greeting hi" in server.log()  # the file outlives the server


def test_exit_before_ready_quotes_the_log():
    code = "print('cannot load the model', flush=True); raise SystemExit(3)"
    with pytest.raises(ServerError, match=r"(?s)exited with status 3.*cannot load the model"):
        ServerProcess("m", command=stand_in(code), timeout=60)


def test_not_ready_in_time_is_stopped():
    code = "import time; print('loading', flush=True); time.sleep(120)"
    server = ServerProcess("m", command=stand_in(code), wait=False)
    with pytest.raises(ServerError, match=r"(?s)not ready within 0.5 s.*loading"):
        server.wait_ready(0.5)
    assert server.stop(timeout=10) == -signal.SIGTERM


def test_appended_log_reads_its_own_part(tmp_path):
    log = tmp_path / "server.log"
    for greeting in ("first", "second"):
        with ServerProcess("m", command=stand_in(HEALTH), env={"GREETING": greeting},
                           log=log, append_log=True, timeout=60) as server:
            pass
    assert "greeting second" in server.log() and "greeting first" not in server.log()
    assert "greeting first" in log.read_text()


def test_sigint_reaches_the_server_where_this_process_ignores_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = ServerProcess("m", command=stand_in(HEALTH), timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert server.stop(signal.SIGINT, timeout=10) == -signal.SIGINT  # not killed


def test_ranks_get_a_run_of_free_ports(monkeypatch):
    """mlx.launch's ring binds --starting-port plus each rank: every port of
    the run must be free, not only the first (a taken second port failed CI
    with "[ring] Couldn't bind socket")."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # The first run tried has its second port taken; the next is free.
    starts = iter([port - 1, port + 1])
    monkeypatch.setattr(launcher.random, "randrange", lambda *_: next(starts))
    try:
        command = launcher.distributed_command(2)
    finally:
        taken.close()
    start = int(command[command.index("--starting-port") + 1])
    assert start == port + 1
