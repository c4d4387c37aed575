"""The shape of the code: no import circles, modules of one idea and a few hundred lines.

Read from the source with ``ast``: every import of a ``tf1_syncbn`` or
``tower`` module counts, including imports inside functions (a circle that
only closes at call time is still a circle for a reader).
"""

import ast
import os

import pytest

#: The source tree, whatever the TF behaviour: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('tf1_syncbn', 'tower')
#: The longest module allowed (lines): "a few hundred lines at most".
MAX_LINES = 450


def _modules():
    """``{module name: path}`` of every module of the packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith('.py'):
                    continue
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == '__init__':
                    parts = parts[:-1]
                found['.'.join(parts)] = path
    return found


def _imports(path, modules):
    """The package modules that the module at ``path`` imports, anywhere in it."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {'%s.%s' % (node.module, alias.name) for alias in node.names}
            names.update(submodules)
            if not submodules & set(modules):      # `from package import submodule`
                names.add(node.module)
    return {n for n in names if n in modules}


def _graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # A package's __init__ re-exports its modules: importing one of them
        # imports the package first, which is not a dependency of the module.
        graph[name] = {m for m in _imports(path, modules) if m != name}
    return graph


def _cycles(graph):
    """Every elementary cycle found by depth-first search (each reported once)."""
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 'active'
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 'active':
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 'done'

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_circles():
    graph = _graph()
    # Package __init__ modules import their members; members never need the
    # package itself, but `from tf1_syncbn import x` names it: drop those edges.
    for name in graph:
        graph[name] = {m for m in graph[name]
                       if not name.startswith(m + '.') or name in PACKAGES}
    assert _cycles(graph) == []


def test_the_checker_finds_a_circle():
    assert _cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == [['a', 'b', 'c', 'a']]


def test_modules_stay_a_few_hundred_lines():
    long = {}
    for name, path in _modules().items():
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            long[name] = lines
    assert long == {}
