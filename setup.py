"""Ships ``mlx_lm_suffix.pth`` at the root of site-packages, for regular and
editable installs, so mlx-lm's stock commands gain suffix decoding as soon as
the package is installed. Everything else is in setup.cfg."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "mlx_lm_suffix.pth"


class BuildPy(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWheel(editable_wheel):
    # setuptools >= 68 writes everything in `unpacked_wheel` into the wheel.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(PTH, unpacked_wheel)
        return out


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
