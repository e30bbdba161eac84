"""Everything is in pyproject.toml, except one file setuptools cannot declare there: ``rlflow-gymnasium.pth``, which
must sit at the top of site-packages (not inside the package) for the interpreter to run it at start-up. It lets
Gymnasium 1.x find ``rlflow/GraphRewrite-v0`` without ``import rlflow`` (see ``src/rlflow/_gym_hook.py``)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "rlflow-gymnasium.pth"
# a .pth line that starts with "import" is executed; a missing rlflow (uninstalled, .pth left behind) is ignored
PTH_LINE = 'import sys; exec("try:\\n import rlflow._gym_hook\\nexcept ImportError:\\n pass")\n'


def write_pth(folder: str) -> Path:
    target = Path(folder) / PTH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(PTH_LINE)
    return target


class BuildWithPth(build_py):
    """A regular wheel: the .pth goes into build_lib, whose top level is site-packages'."""

    def run(self):
        super().run()
        write_pth(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWithPth(editable_wheel):
    """``pip install -e .`` (the Makefile's): setuptools builds the editable wheel from a folder it fills in
    ``_install_namespaces`` (private, present in setuptools 64-84); the .pth joins the namespace files there."""

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        write_pth(installation_dir)


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
