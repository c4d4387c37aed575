"""The shape of the code: who may import whom, no circles, no private imports across packages.

Read from the source with ``ast``: every import of a ``tf1_syncbn`` or
``tower`` module counts, including imports inside functions (a circle that
only closes at call time is still a circle for a reader).

A *package* here is ``tower``, a package or module right under
``tf1_syncbn`` (``tf1_syncbn.slim``, ``tf1_syncbn.timeouts``), or
``tf1_syncbn`` itself (its ``__init__``). :data:`LAYERS` says which packages
each may import (docs/design.md draws them); every package of the tree must
be listed, so a new one is placed on purpose. Besides:

* no circle between modules, and none between packages;
* no private import across packages: a module of one package imports no
  name starting with ``_`` from another, and no ``_`` module of it, except
  the library's internals (:data:`INTERNALS`: ``tf1_syncbn._core``,
  ``._sync``, ``._compute``), which its own packages import;
* ``tower`` imports nothing of ``tf1_syncbn``;
* the top of ``tf1_syncbn/`` holds a dozen public modules at most, and no
  package's ``__init__.py`` below it is over :data:`MAX_FACE_LINES` lines (a
  face: its docstring and re-exports).
"""

import ast
import os

import pytest

#: The source tree, whatever the TF behaviour: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ('tf1_syncbn', 'tower')
#: The most modules right under tf1_syncbn/ (issue 34: "at most about a dozen").
MAX_TOP_MODULES = 12
#: The most lines of a package's ``__init__.py`` below ``tf1_syncbn/`` (issue 44: faces that
#: only face; the logic lives in modules named for what they do).
MAX_FACE_LINES = 100
#: The library's private packages: its internals, which its own packages may import.
INTERNALS = ('tf1_syncbn._frontend', 'tf1_syncbn._core', 'tf1_syncbn._sync', 'tf1_syncbn._compute',
             'tf1_syncbn._graph', 'tf1_syncbn._cli')

_FRONT_END = {'tf1_syncbn._frontend', 'tf1_syncbn.backends', 'tf1_syncbn.errors',
              'tf1_syncbn.timeouts', 'tower'}
#: What imports what: package -> the packages it may import (besides itself).
#: ``'*'``: every package (what users import or run reaches anything).
LAYERS = {
    # The leaves: they import nothing of ours.
    'tower': set(),
    'tf1_syncbn.errors': set(),
    'tf1_syncbn.timeouts': set(),
    # python -m tf1_syncbn.launch, its supervisor and restart policy (it also runs by its
    # path, without the package: the standard library only).
    'tf1_syncbn.launch': set(),
    # The commands' parsers, answering --help before TensorFlow loads: the standard library.
    'tf1_syncbn._cli': set(),
    'tf1_syncbn.kernels': {'tf1_syncbn._cli'},
    # The library's per-graph cache, on tower's root graph.
    'tf1_syncbn._graph': {'tower'},
    # Communication, then computation, then synchronization, then the core.
    'tf1_syncbn.backends': {'tf1_syncbn.timeouts', 'tf1_syncbn.errors'},
    'tf1_syncbn._compute': {'tf1_syncbn.backends', 'tf1_syncbn.timeouts', 'tf1_syncbn._graph',
                            'tower'},
    'tf1_syncbn.kernel_sets': {'tf1_syncbn._compute', 'tf1_syncbn.kernels', 'tf1_syncbn._graph',
                               'tower'},
    'tf1_syncbn._sync': {'tf1_syncbn._compute', 'tf1_syncbn.backends', 'tf1_syncbn.timeouts',
                         'tf1_syncbn.errors', 'tf1_syncbn.kernels', 'tf1_syncbn._graph', 'tower'},
    'tf1_syncbn._core': {'tf1_syncbn._sync', 'tf1_syncbn._compute', 'tf1_syncbn.kernel_sets',
                         'tf1_syncbn.backends', 'tf1_syncbn.timeouts', 'tf1_syncbn.errors',
                         'tf1_syncbn._graph', 'tower'},
    # What the front-ends share: their two doors (building a call, patching) and the kit.
    'tf1_syncbn._frontend': {'tf1_syncbn._core', 'tf1_syncbn._graph', 'tf1_syncbn.errors'},
    # The front-ends: the core through the kit's doors, and the public leaves, never each other.
    'tf1_syncbn.slim': _FRONT_END,
    'tf1_syncbn.tensorpack': _FRONT_END,
    'tf1_syncbn.layers': _FRONT_END,
    'tf1_syncbn.keras': _FRONT_END,
    'tf1_syncbn.nn': _FRONT_END,
    # Beside the layers: the audit reads graphs only (not the core that builds them).
    'tf1_syncbn.audit': {'tf1_syncbn._cli', 'tf1_syncbn.backends', 'tf1_syncbn.errors', 'tower'},
    'tf1_syncbn.export': {'tf1_syncbn._core', 'tf1_syncbn._compute', 'tf1_syncbn.backends',
                          'tf1_syncbn.errors', 'tf1_syncbn.kernels'},
    # (The launch package: the restart environment and the chief's start line.)
    'tf1_syncbn.distributed': {'tf1_syncbn._sync', 'tf1_syncbn.backends', 'tf1_syncbn.timeouts',
                               'tf1_syncbn.errors', 'tf1_syncbn.launch', 'tower'},
    # What users import or run.
    # python -m tf1_syncbn.run: the front-ends' public patches, the audit, and the
    # front-ends' patching door (yielding, which Keras 2 package).
    'tf1_syncbn.run': {'tf1_syncbn._frontend', 'tf1_syncbn.audit', 'tf1_syncbn.layers',
                       'tf1_syncbn.slim', 'tf1_syncbn.tensorpack', 'tf1_syncbn.keras'},
    'tf1_syncbn.selftest': '*',
    'tf1_syncbn': '*',
}


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


def _sources():
    """``{module name: source}`` of the tree."""
    sources = {}
    for name, path in _modules().items():
        with open(path) as f:
            sources[name] = f.read()
    return sources


def _imports(source, modules):
    """``[(module, names)]``: each import of a module of ``modules`` in ``source``, anywhere.

    ``from package import submodule`` imports the submodule (not the
    package); ``names`` are the names imported from a module (empty for
    ``import module``).
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = []
            for alias in node.names:
                submodule = '%s.%s' % (node.module, alias.name)
                if submodule in modules:
                    found.append((submodule, ()))
                else:
                    names.append(alias.name)
            if names and node.module in modules:
                found.append((node.module, tuple(names)))
    return found


def package_of(module):
    """The package (see the module docstring) a module belongs to."""
    parts = module.split('.')
    return '.'.join(parts[:1 if parts[0] == 'tower' else 2])


def _module_graph(sources):
    """``{module: {imported modules}}``, a module's own package ``__init__`` left out.

    Importing a module imports its packages' ``__init__`` first, which
    re-export their members: that is no dependency of the member.
    """
    graph = {}
    for name, source in sources.items():
        graph[name] = {target for target, _ in _imports(source, sources)
                       if target != name and not name.startswith(target + '.')}
    return graph


def _package_graph(sources):
    graph = {}
    for name, targets in _module_graph(sources).items():
        graph.setdefault(package_of(name), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(name))
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


def layering_violations(sources, layers=None):
    """``['module imports target: why']`` for every import :data:`LAYERS` does not allow."""
    layers = LAYERS if layers is None else layers
    found = []
    for name, source in sorted(sources.items()):
        package = package_of(name)
        allowed = layers.get(package)
        if allowed == '*':
            allowed = set(layers) - {package}
        for target, _ in _imports(source, sources):
            other = package_of(target)
            if other == package:
                continue
            if allowed is None:
                found.append('%s: its package %s has no place in LAYERS' % (name, package))
            elif other not in allowed:
                found.append('%s imports %s: %s may import %s' % (
                    name, target, package,
                    ', '.join(sorted(allowed)) + ' only' if allowed else 'nothing of ours'))
    return found


def private_violations(sources):
    """``['module imports target.name: why']`` for every private import across packages."""
    found = []
    for name, source in sorted(sources.items()):
        package = package_of(name)
        for target, names in _imports(source, sources):
            other = package_of(target)
            if other == package:
                continue
            inside = target.split('.')[len(other.split('.')):]
            internal = other in INTERNALS and package.startswith('tf1_syncbn')
            if other.split('.')[-1].startswith('_') and not internal:
                found.append('%s imports %s: a private package of tf1_syncbn' % (name, target))
            if any(part.startswith('_') for part in inside):
                found.append('%s imports %s: a private module of %s' % (name, target, other))
            found.extend('%s imports %s.%s: a private name of %s' % (name, target, n, other)
                         for n in names if n.startswith('_') and not n.startswith('__'))
    return found


def top_level_problems(modules):
    """What is wrong with the modules right under ``tf1_syncbn/`` (their names)."""
    top = sorted(m for m in modules if m.count('.') == 1 and m.startswith('tf1_syncbn.'))
    problems = ['tf1_syncbn/%s.py is private: it belongs in a package (the top holds only '
                'what users import or run)' % m.split('.')[1]
                for m in top if m.split('.')[1].startswith('_')]
    if len(top) > MAX_TOP_MODULES:
        problems.append('%d modules at the top of tf1_syncbn/ (at most %d): %s' % (
            len(top), MAX_TOP_MODULES, ', '.join(top)))
    return problems


def _top_modules():
    """The top of ``tf1_syncbn/``: its ``.py`` files (packages are folders, not counted)."""
    folder = os.path.join(ROOT, 'tf1_syncbn')
    return ['tf1_syncbn.' + n[:-3] for n in os.listdir(folder)
            if n.endswith('.py') and n != '__init__.py']


def test_the_top_of_tf1_syncbn_holds_a_dozen_public_modules_at_most():
    assert top_level_problems(_top_modules()) == []


def test_the_top_level_checker_finds_private_and_too_many_modules():
    assert top_level_problems(['tf1_syncbn._moments', 'tf1_syncbn.timeouts',
                               'tf1_syncbn.slim.layer']) == [
        'tf1_syncbn/_moments.py is private: it belongs in a package (the top holds only what '
        'users import or run)']
    many = ['tf1_syncbn.m%02d' % i for i in range(MAX_TOP_MODULES + 1)]
    assert len(top_level_problems(many)) == 1
    assert top_level_problems(many[:-1]) == []


def face_problems(faces):
    """What is wrong with the faces below ``tf1_syncbn``: ``faces`` is ``{package: the source of
    its __init__.py}`` (``tf1_syncbn``'s own, the public API, is the top: not below it)."""
    return ['%s/__init__.py has %d lines (at most %d): keep the face to its docstring and '
            're-exports, and move the body into modules named for what they do' % (
                name.replace('.', '/'), len(source.splitlines()), MAX_FACE_LINES)
            for name, source in sorted(faces.items())
            if name.startswith('tf1_syncbn.') and len(source.splitlines()) > MAX_FACE_LINES]


def _faces():
    """``{package: the source of its __init__.py}`` of the tree."""
    faces = {}
    for name, path in _modules().items():
        if os.path.basename(path) == '__init__.py':
            with open(path) as f:
                faces[name] = f.read()
    return faces


def test_no_package_face_below_the_top_is_over_100_lines():
    faces = _faces()
    assert {'tf1_syncbn', 'tf1_syncbn.export', 'tf1_syncbn.launch', 'tower'} <= set(faces)
    assert face_problems(faces) == []


def test_the_face_checker_finds_a_long_init_below_the_top_only():
    long, short = 'x = 1\n' * (MAX_FACE_LINES + 1), 'x = 1\n' * MAX_FACE_LINES
    assert face_problems({'tf1_syncbn': long, 'tf1_syncbn.export': long,
                          'tf1_syncbn.kernels': short, 'tower': long}) == [
        'tf1_syncbn/export/__init__.py has 101 lines (at most 100): keep the face to its '
        'docstring and re-exports, and move the body into modules named for what they do']


def test_every_package_has_its_place_in_the_layers():
    packages = {package_of(m) for m in _modules()}
    assert packages == set(LAYERS), 'add new packages to LAYERS (and docs/design.md)'


def test_who_may_import_whom():
    assert layering_violations(_sources()) == []


def test_no_private_imports_across_packages():
    assert private_violations(_sources()) == []


def test_no_import_circles_between_modules():
    assert _cycles(_module_graph(_sources())) == []


def test_no_import_circles_between_packages():
    assert _cycles(_package_graph(_sources())) == []


#: A small tree with one violation of each kind (and a module that breaks none).
SYNTHETIC = {
    'tower': '',
    'tower.context': 'from tf1_syncbn.errors import SyncBNWarning\n',
    'tf1_syncbn': 'from tf1_syncbn.slim import layer\n',
    'tf1_syncbn.errors': '',
    'tf1_syncbn.slim': '', 'tf1_syncbn.keras': '', 'tf1_syncbn.audit': '',
    'tf1_syncbn.distributed': '', 'tf1_syncbn._core': '', 'tf1_syncbn._sync': '',
    'tf1_syncbn.slim.layer': ('from tf1_syncbn._core.call import batch_norm\n'
                              'def f():\n    from tf1_syncbn.keras.layer import BN\n'),
    'tf1_syncbn.keras.layer': 'from tf1_syncbn.errors import SyncBNWarning\n',
    'tf1_syncbn.audit.rules': 'import tf1_syncbn._core.call\n',
    'tf1_syncbn.distributed.peers': ('from tf1_syncbn.keras.layer import _keras_bn\n'
                                     'from tf1_syncbn.slim._private import x\n'),
    'tf1_syncbn.slim._private': '',
    'tf1_syncbn._core.call': 'from tf1_syncbn._sync import group\n',
    'tf1_syncbn._sync.group': 'from tf1_syncbn._core.call import batch_norm\n',
}


#: The layers the synthetic tree is checked against (fixed, whatever LAYERS becomes).
SYNTHETIC_LAYERS = {
    'tower': set(), 'tf1_syncbn.errors': set(),
    'tf1_syncbn._sync': {'tf1_syncbn.errors', 'tower'},
    'tf1_syncbn._core': {'tf1_syncbn._sync', 'tf1_syncbn.errors', 'tower'},
    'tf1_syncbn.slim': {'tf1_syncbn._core', 'tf1_syncbn.errors', 'tower'},
    'tf1_syncbn.keras': {'tf1_syncbn._core', 'tf1_syncbn.errors', 'tower'},
    'tf1_syncbn.audit': {'tf1_syncbn.errors', 'tower'},
    'tf1_syncbn.distributed': {'tf1_syncbn.keras', 'tf1_syncbn.slim'},
    'tf1_syncbn': '*',
}


def test_the_checkers_find_each_kind_of_violation():
    assert layering_violations(SYNTHETIC, SYNTHETIC_LAYERS) == [
        'tf1_syncbn._sync.group imports tf1_syncbn._core.call: tf1_syncbn._sync may import '
        'tf1_syncbn.errors, tower only',
        'tf1_syncbn.audit.rules imports tf1_syncbn._core.call: tf1_syncbn.audit may import '
        'tf1_syncbn.errors, tower only',
        'tf1_syncbn.slim.layer imports tf1_syncbn.keras.layer: tf1_syncbn.slim may import '
        'tf1_syncbn._core, tf1_syncbn.errors, tower only',
        'tower.context imports tf1_syncbn.errors: tower may import nothing of ours']
    assert private_violations(SYNTHETIC) == [
        'tf1_syncbn.distributed.peers imports tf1_syncbn.keras.layer._keras_bn: a private '
        'name of tf1_syncbn.keras',
        'tf1_syncbn.distributed.peers imports tf1_syncbn.slim._private: a private module of '
        'tf1_syncbn.slim']
    assert _cycles(_module_graph(SYNTHETIC)) == [
        ['tf1_syncbn._core.call', 'tf1_syncbn._sync.group', 'tf1_syncbn._core.call']]
    assert _cycles(_package_graph(SYNTHETIC)) == [
        ['tf1_syncbn._core', 'tf1_syncbn._sync', 'tf1_syncbn._core']]
    assert layering_violations({'tf1_syncbn.new': ''}) == []       # no import: nothing to say
    assert layering_violations({'tf1_syncbn.new': 'import tower\n', 'tower': ''}) == [
        'tf1_syncbn.new: its package tf1_syncbn.new has no place in LAYERS']
    assert private_violations({'tower.x': 'from tf1_syncbn._core import call\n',
                               'tf1_syncbn._core': '', 'tf1_syncbn._core.call': ''}) == [
        'tower.x imports tf1_syncbn._core.call: a private package of tf1_syncbn']


def test_the_checkers_pass_a_tree_that_keeps_the_rules():
    tree = {'tower': '', 'tower.context': 'import tower.graph_state\n', 'tower.graph_state': '',
            'tf1_syncbn._core': '', 'tf1_syncbn.slim': '', 'tf1_syncbn._frontend': '',
            'tf1_syncbn._core.call': 'from tower.graph_state import root_graph\n',
            'tf1_syncbn._frontend.building': 'from tf1_syncbn._core.call import batch_norm\n',
            'tf1_syncbn.slim.layer': ('from tf1_syncbn._frontend.building import batch_norm\n'
                                      'from tf1_syncbn.slim import _helper\n'),
            'tf1_syncbn.slim._helper': ''}
    assert layering_violations(tree) == [] and private_violations(tree) == []
    assert _cycles(_module_graph(tree)) == [] and _cycles(_package_graph(tree)) == []


# -- The front-ends' seam (issue 44) ---------------------------------------------------------

#: The front-ends: each translates one library's batch norm into calls of the core.
FRONT_ENDS = ('tf1_syncbn.slim', 'tf1_syncbn.tensorpack', 'tf1_syncbn.layers', 'tf1_syncbn.keras',
              'tf1_syncbn.nn')
#: The most private modules a front-end (or the runner) imports: one door for building a call
#: (tf1_syncbn._frontend.building), one for patching (tf1_syncbn._frontend.patching).
MAX_PRIVATE_MODULES = 2
#: What every front-end folder holds (tf1_syncbn.nn, a front-end without a patch, is one file).
FRONT_END_FILES = ('layer.py', 'rules.py', 'patch.py')


def _is_private(module):
    """Whether a dotted module path goes through a private package or module."""
    return any(part.startswith('_') and not part.startswith('__') for part in module.split('.'))


def seam_violations(sources, packages=FRONT_ENDS + ('tf1_syncbn.run',),
                    most=MAX_PRIVATE_MODULES):
    """``['package imports N private modules (at most M): ...']`` for each wide seam."""
    found = []
    for package in packages:
        private = set()
        for name, source in sources.items():
            if package_of(name) == package:
                private.update(target for target, _ in _imports(source, sources)
                               if package_of(target) != package and _is_private(target))
        if len(private) > most:
            found.append('%s imports %d private modules (at most %d): %s' % (
                package, len(private), most, ', '.join(sorted(private))))
    return found


def front_end_shape_problems(files):
    """What is missing from the front-end folders.

    Args:
      files: ``{front-end package: the names of the files in its folder}``, or
        None for a front-end that is one module.
    """
    problems = []
    for package, names in sorted(files.items()):
        missing = [f for f in FRONT_END_FILES if names is not None and f not in names]
        if missing:
            problems.append('%s/ has no %s: every front-end folder holds %s' % (
                package.replace('.', '/'), ', '.join(missing), ', '.join(FRONT_END_FILES)))
    return problems


def _front_end_files():
    found = {}
    for package in FRONT_ENDS:
        folder = os.path.join(ROOT, *package.split('.'))
        found[package] = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
    return found


def _public_all(tree):
    """The names a module's ``ast`` lists in ``__all__`` (literals, also added with ``+=``)."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        if any(isinstance(t, ast.Name) and t.id == '__all__' for t in targets):
            try:
                names.update(ast.literal_eval(node.value))
            except ValueError:
                pass
    return names


def private_homes(sources):
    """``['module.name: ...']`` for each public name that a public module takes from a private one.

    A name in a public module's ``__all__`` imported from a module of a
    private package (``tf1_syncbn._core.moments``) lives where users cannot
    reach it by its module path: it needs a public module of its own.
    """
    found = []
    for name, source in sorted(sources.items()):
        if _is_private(name):
            continue
        tree = ast.parse(source)
        public = _public_all(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module in sources and _is_private(node.module):
                found.extend('%s.%s is defined in the private %s: give it a public module' % (
                    name, alias.asname or alias.name, node.module)
                    for alias in node.names if (alias.asname or alias.name) in public)
    return found


def test_each_front_end_imports_two_private_modules_at_most():
    assert seam_violations(_sources()) == []


def test_every_front_end_folder_holds_layer_rules_and_patch():
    assert front_end_shape_problems(_front_end_files()) == []


def test_every_public_name_lives_in_a_public_module():
    assert private_homes(_sources()) == []


def test_the_seam_checkers_find_each_kind_of_violation():
    tree = {
        'tf1_syncbn._core': '', 'tf1_syncbn._core.call': '', 'tf1_syncbn._core.moments': '',
        'tf1_syncbn._core.options': '', 'tf1_syncbn._frontend': '',
        'tf1_syncbn._frontend.building': '', 'tf1_syncbn._frontend.patching': '',
        # Three private modules: the core's, besides the two doors.
        'tf1_syncbn.slim.layer': ('from tf1_syncbn._frontend.building import batch_norm\n'
                                  'from tf1_syncbn._core.options import check_options\n'),
        'tf1_syncbn.slim.patch': 'from tf1_syncbn._frontend import patching\n',
        # Two doors, and its own private module (not counted).
        'tf1_syncbn.keras.layer': ('from tf1_syncbn._frontend.building import batch_norm\n'
                                   'from tf1_syncbn.keras import _helpers\n'),
        'tf1_syncbn.keras.patch': 'import tf1_syncbn._frontend.patching\n',
        'tf1_syncbn.keras._helpers': '',
        # A public name defined in a private module, and one re-exported from a public one.
        'tf1_syncbn': ('from tf1_syncbn._core.moments import moments as moments\n'
                       'from tf1_syncbn._core.call import _private\n'
                       'from tf1_syncbn.slim.layer import sync_batch_norm\n'
                       "__all__ = ['sync_batch_norm']\n__all__ += ['moments']\n"),
    }
    assert seam_violations(tree, ('tf1_syncbn.slim', 'tf1_syncbn.keras')) == [
        'tf1_syncbn.slim imports 3 private modules (at most 2): tf1_syncbn._core.options, '
        'tf1_syncbn._frontend.building, tf1_syncbn._frontend.patching']
    assert seam_violations(tree, ('tf1_syncbn.slim',), most=3) == []
    assert private_homes(tree) == [
        'tf1_syncbn.moments is defined in the private tf1_syncbn._core.moments: give it a '
        'public module']
    assert front_end_shape_problems({
        'tf1_syncbn.slim': ['__init__.py', 'layer.py', 'patch.py'],
        'tf1_syncbn.tensorpack': ['__init__.py', 'api.py', 'layer.py', 'patch.py'],
        'tf1_syncbn.layers': ['__init__.py', 'layer.py', 'patch.py', 'rules.py'],
        'tf1_syncbn.nn': None}) == [
        'tf1_syncbn/slim/ has no rules.py: every front-end folder holds layer.py, rules.py, '
        'patch.py',
        'tf1_syncbn/tensorpack/ has no rules.py: every front-end folder holds layer.py, '
        'rules.py, patch.py']


#: What runs before TensorFlow is imported, where the package cannot be imported: the
#: ``.pth`` hook's module and the runner's start (loaded by path). The standard library only.
BEFORE_TENSORFLOW = ('_tf1_syncbn_run.py', os.path.join('tf1_syncbn', 'run', 'startup.py'))


def non_standard_imports(source):
    """The top-level names of the modules ``source`` imports that are not the standard library."""
    import sys  # noqa: PLC0415
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add('.' if node.level else node.module.split('.')[0])
    return sorted(found - set(sys.stdlib_module_names))


@pytest.mark.parametrize('path', BEFORE_TENSORFLOW)
def test_what_runs_before_tensorflow_imports_only_the_standard_library(path):
    with open(os.path.join(ROOT, path)) as f:
        assert non_standard_imports(f.read()) == []


def test_the_standard_library_checker_finds_other_imports():
    assert non_standard_imports('import os, numpy\nfrom tf1_syncbn import x\n'
                                'from . import y\nfrom json import dumps\n') == [
        '.', 'numpy', 'tf1_syncbn']
