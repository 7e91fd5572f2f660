"""Build hook: ship ``hf-fp8-autoload.pth`` at the top of site-packages (metadata: pyproject.toml).

The ``.pth`` line imports ``_hf_fp8_autoload`` (standard library only) at interpreter start;
it registers hf_fp8 with transformers when transformers' quantizer registry is imported, so
an hf_fp8 checkpoint loads correctly without ``import hf_fp8``. The file is listed in the
wheel's RECORD, so ``pip uninstall hf-fp8`` removes it. Regular wheels get it from
``build_py``'s output; editable installs (``pip install -e``) put it into the editable wheel,
whose install folder setuptools exposes as ``install.install_lib`` while building.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "hf-fp8-autoload.pth"
# One line; a .pth line that starts with "import" is executed by site.py. Never raises.
PTH_LINE = (
    "import sys; exec('try:\\n import _hf_fp8_autoload\\n _hf_fp8_autoload.install()\\n"
    "except Exception:\\n pass')\n"
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the autoload ``.pth`` next to the packages."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            target = self.get_finalized_command("install").install_lib  # the editable wheel
        else:
            target = self.build_lib
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, PTH_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)
        self._pth_output = path

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
