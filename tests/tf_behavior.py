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
"""

import os

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
