"""A shim over ``pyproject.toml``, where the package is declared.

For the habits ``python setup.py develop`` / ``python setup.py install`` and
``pip install -e .`` on pips older than 21.3 (before PEP 660 editable
installs), which look for a ``setup.py``. Everything (name, version,
dependencies, packages, the kernel sources) is read from ``pyproject.toml``
by setuptools (77 or newer, as ``[build-system]`` requires).
"""

from setuptools import setup

setup()
