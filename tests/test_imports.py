"""Every module imports on its own in a fresh interpreter (the startup hook
patches mlx-lm while our modules import it: no circular imports)."""

import pkgutil
import subprocess
import sys

import pytest

import mlx_lm_suffix

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(mlx_lm_suffix.__path__, "mlx_lm_suffix.")
    if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_first(name):
    out = subprocess.run([sys.executable, "-c", f"import {name}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
