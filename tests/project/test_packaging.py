"""``setup.py``: a shim over ``pyproject.toml`` that installs the package.

In a copy of the tree (so no build output lands in the repository):
``python setup.py --version`` answers from ``pyproject.toml``, and pip
installs the copy (``--no-build-isolation --no-deps``, into a folder: no
network, no new environment), with every package of the tree, the kernel
sources and the runner's start-up hook (``tf1_syncbn_run.pth`` and its
``_tf1_syncbn_run`` module at the top); an editable wheel (PEP 660, what
``pip install -e .`` installs) carries the hook too.
"""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

#: The source tree, whatever the TF behaviour: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: What the package is built from (MANIFEST.in prunes the rest).
SOURCES = ('setup.py', 'pyproject.toml', 'README.md', 'LICENSE', 'MANIFEST.in',
           'tf1_syncbn', 'tower', '_tf1_syncbn_run.py', 'tf1_syncbn_run.pth')
#: The runner's start-up hook, at the top of site-packages.
HOOK = ('tf1_syncbn_run.pth', '_tf1_syncbn_run.py')


def _packages(root):
    """The package folders (relative, ``/``-separated) under ``root``: those with an __init__."""
    found = set()
    for name in ('tf1_syncbn', 'tower'):
        for folder, dirs, files in os.walk(os.path.join(root, name)):
            dirs[:] = [d for d in dirs if d != '__pycache__']
            if '__init__.py' in files:
                found.add(os.path.relpath(folder, root).replace(os.sep, '/'))
    return found


def _tree(tmp_path):
    tree = tmp_path / 'tree'
    tree.mkdir()
    for name in SOURCES:
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns('__pycache__'))
        elif os.path.exists(source):
            shutil.copy(source, tree / name)
    return tree


def test_setup_py_installs_the_package(tmp_path):
    tree = _tree(tmp_path)
    env = dict(os.environ, PYTHONPATH='', PIP_DISABLE_PIP_VERSION_CHECK='1')

    version = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=str(tree), env=env,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0, version.stderr[-3000:]
    import tf1_syncbn
    assert version.stdout.split()[-1] == tf1_syncbn.__version__

    site = tmp_path / 'site'
    install = subprocess.run(
        [sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--no-build-isolation',
         '--no-index', '--target', str(site), str(tree)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert _packages(str(site)) == _packages(ROOT)
    assert os.path.exists(site / 'tf1_syncbn' / 'kernels' / 'sync_bn_ops.cc')
    assert any(n.startswith('tf1_syncbn-') and n.endswith('.dist-info')
               for n in os.listdir(site)), os.listdir(site)
    for name in HOOK:
        with open(site / name) as installed, open(os.path.join(ROOT, name)) as source:
            assert installed.read() == source.read(), name


def test_an_editable_wheel_carries_the_start_up_hook(tmp_path):
    """``pip install -e .``'s wheel (PEP 660): the ``.pth`` file, and the module it imports
    found by the editable finder in the tree."""
    tree = _tree(tmp_path)
    build = subprocess.run(
        [sys.executable, '-c', 'from setuptools import build_meta; '
         'print(build_meta.build_editable(%r))' % str(tmp_path / 'dist')],
        cwd=str(tree), env=dict(os.environ, PYTHONPATH=''), capture_output=True, text=True,
        timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = zipfile.ZipFile(str(tmp_path / 'dist' / build.stdout.split()[-1]))
    assert wheel.read('tf1_syncbn_run.pth').decode() == open(
        os.path.join(ROOT, 'tf1_syncbn_run.pth')).read()
    finder, = [n for n in wheel.namelist() if n.endswith('_finder.py')]
    assert "'_tf1_syncbn_run': %r" % str(tree / '_tf1_syncbn_run') in wheel.read(finder).decode()
