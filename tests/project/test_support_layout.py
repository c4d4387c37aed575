"""The shape of tests/support: a few shared helpers at the top, the rest in for_<package>/ folders.

Issue 44: ``tests/support/`` in sub-folders that mirror the packages, with at
most :data:`MAX_TOP_MODULES` modules at its top (the helpers every package's
tests share). Every helper is imported by its bare name, wherever it lives
(``support_paths``: tests/support and its ``for_*`` folders are on the path),
which holds only if:

* a sub-folder is either a package imported by its name (``conformance/``,
  ``unchanged/``: with an ``__init__.py``) or a folder of helpers named
  ``for_<a folder of tests/>`` without one (so that no folder is itself
  imported as a package: ``keras/`` or ``tensorpack/`` would shadow the real
  one, as an empty namespace package, where that is missing);
* no module name is in two of those folders (one would shadow the other),
  nor anywhere else on the path (an installed module, the tree's packages,
  the standard library);
* every ``tests/support/...`` path the docs and the code name exists.
"""

import glob
import importlib.machinery
import os
import re
import sys

import pytest

import support_paths

#: The tree's layout, whatever the TF behaviour: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(ROOT, 'tests', 'support')
#: The most modules at the top of tests/support (issue 44: "at most 15 modules at its top").
MAX_TOP_MODULES = 15


def layout_problems(tree, test_folders, taken):
    """What is wrong with tests/support's layout.

    Args:
      tree: ``{folder: [its file names]}``, ``''`` for the top (sub-folders of
        sub-folders are not looked at).
      test_folders: the folders of ``tests/`` (the packages the helpers serve).
      taken: whether a module name is importable from elsewhere than the helpers.
    """
    problems = []
    top = sorted(n for n in tree.get('', []) if n.endswith('.py'))
    if len(top) > MAX_TOP_MODULES:
        problems.append('%d modules at the top of tests/support (at most %d): move the helpers '
                        'of one package\'s tests to for_<package>/' % (len(top), MAX_TOP_MODULES))
    homes = {}
    for folder, names in sorted(tree.items()):
        package = '__init__.py' in names
        if folder and folder.startswith(support_paths.PREFIX):
            if package:
                problems.append('tests/support/%s/ has an __init__.py: a for_ folder is on the '
                                'path, its modules imported by their names' % folder)
                continue
            if folder[len(support_paths.PREFIX):] not in test_folders:
                problems.append('tests/support/%s/ mirrors no folder of tests/ (%s)' % (
                    folder, ', '.join(sorted(test_folders))))
        elif folder:
            if not package:
                problems.append('tests/support/%s/ is neither a package (no __init__.py) nor a '
                                'folder of helpers (for_<package>/): its name imports as an empty '
                                'namespace package where no module of that name is installed'
                                % folder)
            continue
        for name in names:
            if name.endswith('.py'):
                homes.setdefault(name[:-3], []).append(folder)
    for module, folders in sorted(homes.items()):
        where = ', '.join('tests/support/%s' % (f + '/' if f else '') for f in folders)
        if len(folders) > 1:
            problems.append('%s.py is in %s: one shadows the other' % (module, where))
        if taken(module):
            problems.append('%s.py (%s) has the name of a module importable from elsewhere: one '
                            'shadows the other' % (module, where))
    return problems


def _tree():
    tree = {'': os.listdir(SUPPORT)}
    for name in os.listdir(SUPPORT):
        if os.path.isdir(os.path.join(SUPPORT, name)) and not name.startswith(('_', '.')):
            tree[name] = os.listdir(os.path.join(SUPPORT, name))
    return tree


def _test_folders():
    tests = os.path.join(ROOT, 'tests')
    return {n for n in os.listdir(tests)
            if os.path.isdir(os.path.join(tests, n)) and n not in ('support', 'data')
            and not n.startswith(('_', '.'))}


def _taken(name):
    """Whether ``name`` is importable from the path without the helpers' folders.

    The path as a test process starts with it: the installed packages and the repository's
    root. The folders of tests/ (the helpers' among them), and tools/ and examples/, which
    some tests put on ``sys.path`` for their scripts, are left out.
    """
    if name in sys.builtin_module_names or name in getattr(sys, 'stdlib_module_names', ()):
        return True
    scripts = tuple(os.path.join(os.path.abspath(ROOT), d) for d in ('tests', 'tools', 'examples'))
    path = [p for p in sys.path
            if not any(os.path.abspath(p or '.') in (d,) or
                       os.path.abspath(p or '.').startswith(d + os.sep) for d in scripts)]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    return spec is not None and spec.loader is not None       # a namespace folder is no module


def test_tests_support_keeps_its_layout():
    assert layout_problems(_tree(), _test_folders(), _taken) == []


def test_the_layout_checker_finds_each_kind_of_violation():
    top = ['m%02d.py' % i for i in range(MAX_TOP_MODULES)]
    keeps = {'': top, 'for_keras': ['keras_cases.py'],
             'conformance': ['__init__.py', 'matrix.py']}
    assert layout_problems(keeps, {'keras'}, lambda name: False) == []
    tree = {'': top + ['m99.py', 'shared.py', 'numpy.py'],
            'for_keras': ['keras_cases.py', 'shared.py', '__pycache__'],
            'for_nothing': ['a.py'], 'for_layers': ['__init__.py', 'b.py'],
            'keras': ['c.py'], 'conformance': ['__init__.py', 'matrix.py']}
    assert layout_problems(tree, {'keras', 'layers'}, lambda name: name == 'numpy') == [
        '18 modules at the top of tests/support (at most 15): move the helpers of one '
        'package\'s tests to for_<package>/',
        'tests/support/for_layers/ has an __init__.py: a for_ folder is on the path, its modules '
        'imported by their names',
        'tests/support/for_nothing/ mirrors no folder of tests/ (keras, layers)',
        'tests/support/keras/ is neither a package (no __init__.py) nor a folder of helpers '
        '(for_<package>/): its name imports as an empty namespace package where no module of '
        'that name is installed',
        'numpy.py (tests/support/) has the name of a module importable from elsewhere: one '
        'shadows the other',
        'shared.py is in tests/support/, tests/support/for_keras/: one shadows the other']


def test_the_shadowing_check_sees_installed_and_tree_modules():
    assert _taken('numpy') and _taken('tower') and _taken('os') and _taken('tf1_syncbn')
    assert not _taken('tf_behavior') and not _taken('keras_cases')


def test_every_helper_folder_is_on_the_path_of_the_tests_and_of_their_children():
    folders = support_paths.folders()
    assert folders[0] == SUPPORT and len(folders) > 1
    assert set(folders[1:]) == {os.path.join(SUPPORT, n) for n in _tree()
                                if n.startswith(support_paths.PREFIX)}
    inherited = os.environ['PYTHONPATH'].split(os.pathsep)
    assert all(p in sys.path and p in inherited for p in support_paths.paths())


#: ``tests/support/<path>``, as the docs and the code name the helpers.
NAMED = re.compile(r'tests/support/([\w/]+(?:\*?\.py|/))')


def missing_paths(texts, exists):
    """The ``tests/support/...`` paths named in ``texts`` (``{file: text}``) that do not exist."""
    return sorted('%s names tests/support/%s, which does not exist' % (name, path)
                  for name, text in texts.items() for path in set(NAMED.findall(text))
                  if not exists(path))


def _exists(path):
    return bool(glob.glob(os.path.join(SUPPORT, path)))


def _texts():
    names = (glob.glob(os.path.join(ROOT, '*.md')) + glob.glob(os.path.join(ROOT, 'docs', '*.md'))
             + glob.glob(os.path.join(ROOT, 'tests', '**', '*.py'), recursive=True)
             + glob.glob(os.path.join(ROOT, 'tools', '*.py')) + [os.path.join(ROOT, 'Makefile')])
    texts = {}
    for name in names:
        if os.path.samefile(name, __file__):      # its synthetic paths
            continue
        with open(name, encoding='utf-8') as f:
            texts[os.path.relpath(name, ROOT)] = f.read()
    return texts


def test_every_helper_the_docs_and_the_code_name_exists():
    assert missing_paths(_texts(), _exists) == []


def test_the_path_checker_finds_a_moved_helper():
    texts = {'docs/a.md': 'see `tests/support/keras_cases.py` and `tests/support/for_layers/`',
             'tests/b.py': '``tests/support/for_layers/port_*.py``, tests/support/forked.py'}
    assert missing_paths(texts, lambda path: path in ('for_layers/', 'for_layers/port_*.py',
                                                      'forked.py')) == [
        'docs/a.md names tests/support/keras_cases.py, which does not exist']
