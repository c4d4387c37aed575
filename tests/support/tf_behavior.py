"""The TensorFlow behaviour a test process runs in: TF2-behaviour graph mode or TF1 behaviour.

TF1-style scripts run on TensorFlow 2 in one of two ways, and the library is
tested in both:

* ``v2``: TF2 behaviour with eager execution off
  (``tf.compat.v1.disable_eager_execution()``): resource variables, control
  flow v2 (``If``/``While`` ops with function bodies), ``TensorShape``
  dimensions as ints;
* ``v1``: TF1 behaviour (``tf.compat.v1.disable_v2_behavior()``, the
  migration recipe): reference variables (a read may alias the buffer an
  assign of the same step updates), v1 control flow (``Switch``/``Merge``),
  ``Dimension`` objects in shapes.

The behaviour is set once, at process start, from ``$TF1_SYNCBN_TEST_BEHAVIOR``
(``v2`` when unset): ``conftest.py`` applies it to the test process, and every
script the tests start (reference scripts of the replaced libraries, worker
processes, child pytest runs) inherits the variable and applies it too, so a
case and its reference always run in the same behaviour.

``make test`` runs the suite twice, once per behaviour. The TF1-behaviour
pass runs every module that builds graphs, with the cases each module picks
(:func:`pick`); tests marked ``@pytest.mark.once`` (what they test does not
depend on the behaviour: the source tree, compiler flags, the launcher's
process handling) run in the TF2-behaviour pass only.
"""

import os

import suite_scope

#: The environment variable that selects the behaviour: ``v1`` or ``v2``.
VARIABLE = 'TF1_SYNCBN_TEST_BEHAVIOR'
BEHAVIORS = ('v2', 'v1')


def name():
    """``'v1'`` or ``'v2'``, from the environment.

    Raises:
      ValueError: for any other value, so that a typo cannot run the suite
        in the wrong behaviour.
    """
    value = os.environ.get(VARIABLE, 'v2').strip().lower() or 'v2'
    if value not in BEHAVIORS:
        raise ValueError('%s=%r: use one of %s.' % (VARIABLE, value, BEHAVIORS))
    return value


def is_v1():
    """Whether this process runs in TF1 behaviour."""
    return name() == 'v1'


def apply():
    """Puts TensorFlow into this process's behaviour; call before building any graph."""
    import tensorflow as tf  # noqa: PLC0415 - callers may set up the environment first
    if is_v1():
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()


def pick(cases, v1_cases):
    """The cases a parametrized test runs in this process's behaviour.

    ``make test`` runs the whole suite in TF2-behaviour graph mode, then again
    in TF1 behaviour. The second pass runs every module that builds graphs,
    but not every case twice: a module names the cases whose paths TF1
    behaviour changes (reference variables and their reads, v1 ``tf.cond``,
    ``Dimension`` shapes, the replaced library's own TF1 path), one per path
    it covers, and the rest run once.

    Args:
      cases: every case (the TF2-behaviour pass runs them all).
      v1_cases: the cases the TF1-behaviour pass runs, a subset of ``cases``.

    Returns:
      ``cases`` or ``v1_cases``, as a list.

    Raises:
      ValueError: when ``v1_cases`` holds a case that ``cases`` does not.
    """
    return suite_scope.subset(cases, v1_cases, is_v1(),
                              'pick: v1 cases %r are not among the cases.')


def flag():
    """The command-line flag of the project's scripts for this behaviour.

    The demo (``examples/train_multitower.py``), ``examples/multi_worker.py``
    and ``python -m tf1_syncbn.selftest`` choose their TF behaviour with
    ``--tf1-behavior``; tests that start them pass this.
    """
    return ['--tf1-behavior'] if is_v1() else []


def environment(behavior):
    """The environment variables that make a child process run in ``behavior``."""
    if behavior not in BEHAVIORS:
        raise ValueError('unknown TF behaviour %r; use one of %s.' % (behavior, BEHAVIORS))
    return {VARIABLE: behavior}


#: Source lines for scripts that cannot import this module (no ``tests/`` on their path).
SOURCE = '''
import os as _os
import tensorflow as _tf
if _os.environ.get(%r, 'v2').strip().lower() == 'v1':
    _tf.compat.v1.disable_v2_behavior()
else:
    _tf.compat.v1.disable_eager_execution()
''' % VARIABLE
