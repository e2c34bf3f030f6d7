"""What mlx_lm_suffix relies on in mlx-lm is checked before patching; an
mlx-lm that lacks any of it stays stock, with one warning, and refuses suffix
drafting in one line."""

import configparser
import os
import subprocess
import sys
from pathlib import Path

import mlx_lm  # (first: mlx_lm_suffix.policy imports mlx_lm)
import mlx_lm.server as server
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from mlx_lm_suffix.patches import compat

sys.path.insert(0, str(Path(__file__).parent))
from test_server import Server, _messages  # noqa: E402

ROOT = Path(__file__).parents[1]
LAUNCHER = [sys.executable, str(Path(__file__).with_name("incompatible_mlx_lm.py"))]
# What the launcher changes (its CHANGE argument), as compat.missing() names it.
CHANGES = {
    "signature": "mlx_lm.server.ResponseGenerator._tokenize(self, tokenizer, request, args)",
    "missing": "mlx_lm.server.ResponseGenerator._next_request",
}
# mlx_lm_suffix imported by the scripts, not by the .pth at start-up.
NO_AUTOLOAD = {"MLX_LM_SUFFIX_AUTOLOAD": "0"}


def test_this_mlx_lm_has_everything():
    assert compat.missing() == []  # (checked through the patches' wrappers)


def _requires():
    """setup.cfg's install_requires: name -> specifiers (of every marker)."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    out = {}
    for line in setup["options"]["install_requires"].strip().splitlines():
        req = Requirement(line)
        out.setdefault(req.name, []).append(req.specifier)
    return out


def test_setup_cfg_requires_the_supported_range():
    (mlx_lm_spec,) = _requires()["mlx-lm"]
    assert mlx_lm_spec == SpecifierSet(compat.SUPPORTED_VERSIONS)
    assert mlx_lm.__version__ in mlx_lm_spec


def test_make_test_oldest_installs_the_lower_bounds():
    make = dict(
        line.split(" := ")
        for line in (ROOT / "Makefile").read_text().splitlines()
        if line.startswith("OLDEST_MLX")
    )
    requires = _requires()
    assert f">={make['OLDEST_MLX_LM']}" in {str(s) for s in requires["mlx-lm"][0]}
    assert {f">={make['OLDEST_MLX']}"} == {str(s) for spec in requires["mlx"] for s in spec}


def test_missing_names_what_changed(monkeypatch):
    monkeypatch.delattr(server.ResponseGenerator, "_next_request")
    monkeypatch.setattr(server.APIHandler, "do_GET", lambda self, path: None)
    monkeypatch.setitem(compat.LOOKUPS, "mlx_lm.server:main", ("argparse", "serve"))
    monkeypatch.setitem(
        compat.ATTRIBUTES, "mlx_lm.generate:GenerationBatch.__init__", ("_matchers", "_gone")
    )
    assert compat.missing() == [
        "mlx_lm.server.ResponseGenerator._next_request",
        "mlx_lm.server.APIHandler.do_GET(self) (found (self, path))",
        "mlx_lm.server.main looking up serve",
        "mlx_lm.generate.GenerationBatch.__init__ setting _gone",
    ]


def _run(change, *args):
    return subprocess.run(
        [*LAUNCHER, change, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **NO_AUTOLOAD),
    )


def _one_warning(stderr, change):
    lines = [line for line in stderr.splitlines() if "mlx-lm-suffix supports" in line]
    assert len(lines) == 1, stderr
    supports = f"supports mlx-lm {compat.SUPPORTED_VERSIONS}; mlx-lm {mlx_lm.__version__} lacks "
    assert supports + CHANGES[change] in lines[0]
    assert lines[0].endswith("mlx-lm runs stock, without suffix decoding.")


def _one_line_refusal(out, what, change):
    """The process exits 2 with the warning and one error line naming
    ``what`` and the supported versions, not a traceback."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    _one_warning(out.stderr, change)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    assert f"{what} needs mlx-lm {compat.SUPPORTED_VERSIONS}" in errors[0]
    assert CHANGES[change] in errors[0]


@pytest.mark.parametrize("change", list(CHANGES))
def test_incompatible_generate_stays_stock(tiny_model_path, change):
    """A wrapped private method of another signature, or missing outright:
    stock generation (command and API) as without the plugin, one warning,
    and one-line refusals of suffix drafting."""
    prompt = ("--prompt", "one two three one two", "--max-tokens", "8", "--ignore-chat-template")
    stock = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", tiny_model_path, *prompt],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **NO_AUTOLOAD),
    )
    assert stock.returncode == 0, stock.stderr
    out = _run(change, "generate", "--model", tiny_model_path, *prompt)
    assert out.returncode == 0, out.stderr
    stock_text = stock.stdout.split("=" * 10)[1]
    assert out.stdout.split("=" * 10)[1] == stock_text
    _one_warning(out.stderr, change)
    _one_line_refusal(
        _run(change, "generate", "--model", tiny_model_path, "--suffix-draft"),
        "--suffix-draft",
        change,
    )
    # The Python API: stock generation, and one-line errors for suffix drafting.
    out = _run(change, "api", tiny_model_path)
    assert out.returncode == 0, out.stderr
    text, drafter, suffix = out.stdout.splitlines()[-3:]
    assert text and text in stock_text
    assert drafter.startswith("IncompatibleMlxLm: mlx-lm-suffix: a SuffixDrafter as")
    assert suffix.startswith("IncompatibleMlxLm: mlx-lm-suffix: draft_model='suffix' needs")
    assert CHANGES[change] in drafter and CHANGES[change] in suffix


@pytest.mark.parametrize("change", list(CHANGES))
def test_incompatible_server_stays_stock(tiny_model_path, tmp_path, change):
    """The server's suffix flags refuse in one line. With ``signature`` the
    stock server serves as without the plugin; a server without
    ``_next_request`` cannot (stock's own loop calls it), so ``missing``
    checks the flags only."""
    if change == "signature":
        server = Server(
            tiny_model_path,
            log_dir=tmp_path,
            name="incompatible",
            launcher=[*LAUNCHER, change, "server"],
            env=NO_AUTOLOAD,
        )
        try:
            status, reply = server.post(
                "/v1/chat/completions",
                {"messages": _messages("one two three"), "max_tokens": 8, "temperature": 0},
            )
            assert status == 200 and reply["choices"][0]["message"]["content"]
            assert "draft_tokens" not in reply["usage"]
            with pytest.raises(Exception, match="404"):
                server.get("/v1/suffix/stats")  # stock: Not Found
            _one_warning(server.log(), change)
        finally:
            server.stop()
    for args, what in (
        (["--draft", "suffix"], "--draft suffix"),
        (["--suffix-policy", "fixed"], "--suffix-policy"),
    ):
        _one_line_refusal(_run(change, "server", "--model", tiny_model_path, *args), what, change)


def test_failing_patch_leaves_everything_stock():
    """A patch whose target cannot be found when it is applied (here past
    the checks, which would otherwise have refused it): the import
    succeeds, one warning, and nothing is patched (every other target was
    there)."""
    code = (
        "import sys\n"
        "import mlx_lm_suffix.patches as patches\n"
        "from mlx_lm_suffix.patches import compat\n"
        "compat.missing = lambda patches=(): []\n"
        "patches.PATCHES.append(compat.Patch('mlx_lm.server:APIHandler.boom', 'x', len))\n"
        "import mlx_lm, mlx_lm.server\n"
        "g = sys.modules['mlx_lm.generate']\n"
        "print([hasattr(f, '__wrapped__') for f in (mlx_lm.stream_generate, g.stream_generate,"
        " g.setup_arg_parser, mlx_lm.server.main, mlx_lm.server.ResponseGenerator._tokenize)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **NO_AUTOLOAD),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([False] * 5)
    warnings = [line for line in out.stderr.splitlines() if "mlx-lm-suffix" in line]
    assert len(warnings) == 1 and "'APIHandler' has no attribute 'boom'" in warnings[0], out.stderr
