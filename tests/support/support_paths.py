"""Where the tests' helpers are: tests/support and its ``for_<package>/`` folders, on the path.

``tests/support/`` keeps at its top the helpers every package's tests share
(``tf_behavior``, ``forked``, the references, ...) and, in one folder per
package, those of one package's tests: ``for_keras/``, ``for_layers/``,
``for_tensorpack/``, ... (the folders of ``tests/``). Every one of these
folders is on ``sys.path``, so a test or a script imports any helper by its
bare name (``import keras_cases``, ``from bn_reference import ...``) wherever
the helper lives. The folders have no ``__init__.py`` and are named
``for_<package>``, so that none is imported as a package itself: a folder
``keras/`` or ``tensorpack/`` would be found as a namespace package where the
real one is missing (``import tensorpack`` succeeding, empty) and reads as if
it were one. (``conformance/`` and ``unchanged/`` are packages, imported by
their names.) ``tests/project/test_support_layout.py`` holds these rules.

The test run (``tests/conftest.py``) puts :func:`paths` on ``sys.path`` and on
the ``PYTHONPATH`` of every process it starts; a test or a script that builds
a child's ``PYTHONPATH`` itself uses :func:`pythonpath`.
"""

import os
import sys

#: tests/support.
HERE = os.path.dirname(os.path.abspath(__file__))
#: The tree's root (tf1_syncbn, tower).
ROOT = os.path.dirname(os.path.dirname(HERE))
#: The prefix of the folders whose modules are on the path (not packages).
PREFIX = 'for_'


def folders():
    """tests/support, then its ``for_*`` folders (sorted): the folders of the helpers."""
    return [HERE] + [os.path.join(HERE, name) for name in sorted(os.listdir(HERE))
                     if name.startswith(PREFIX) and os.path.isdir(os.path.join(HERE, name))]


def paths():
    """What a process needs on its path for the helpers: :func:`folders`, then the root."""
    return folders() + [ROOT]


def install():
    """Puts :func:`paths` first on ``sys.path`` (those not already on it), in order."""
    sys.path[:0] = [p for p in paths() if p not in sys.path]


def pythonpath(inherit=None):
    """A ``PYTHONPATH`` value: :func:`paths`, then ``inherit``'s entries that are not among them.

    Args:
      inherit: a ``PYTHONPATH`` value to keep after the helpers' (None: none).
    """
    own = paths()
    rest = [p for p in (inherit or '').split(os.pathsep) if p and p not in own]
    return os.pathsep.join(own + rest)
