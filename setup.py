"""A shim over ``pyproject.toml``, where the package is declared, plus the runner's start-up hook.

For the habits ``python setup.py develop`` / ``python setup.py install`` and
``pip install -e .`` on pips older than 21.3 (before PEP 660 editable
installs), which look for a ``setup.py``. Everything (name, version,
dependencies, packages, the kernel sources) is read from ``pyproject.toml``
by setuptools (77 or newer, as ``[build-system]`` requires).

What ``pyproject.toml`` cannot say: ``tf1_syncbn_run.pth``, the start-up hook
of ``python -m tf1_syncbn.run``'s environment-variable form
(``TF1_SYNCBN_RUN``; docs/no-code-changes.md), goes to the top of
``site-packages``, beside the ``_tf1_syncbn_run`` module it imports. A ``.pth``
file is not a module, so ``build_py`` below copies it: into the build folder
for a wheel, and into the editable wheel for ``pip install -e .`` (PEP 660),
whose other files setuptools does not copy.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = 'tf1_syncbn_run.pth'


class build_py_with_hook(build_py):
    """``build_py``, plus the start-up hook at the top of the wheel (editable ones included)."""

    def run(self):
        super().run()
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), HOOK)
        if getattr(self, 'editable_mode', False):
            # PEP 660: the editable wheel holds what is in install_lib (setuptools'
            # editable_wheel points it at the unpacked wheel), not build_lib.
            target = self.get_finalized_command('install').install_lib
        else:
            target = self.build_lib
        self.copy_file(source, os.path.join(target, HOOK), preserve_mode=False)

    def get_outputs(self, *args, **kwargs):
        return list(super().get_outputs(*args, **kwargs)) + [os.path.join(self.build_lib, HOOK)]


setup(cmdclass={'build_py': build_py_with_hook})
