"""How long a step may wait for its collectives: the one place for timeout values.

Every timeout of the library (``CollectiveBackend(timeout=...)``,
``TF1_SYNCBN_TIMEOUT``, ``setup_cluster(collective_timeout=...)``) goes
through :func:`validate_timeout`, so that each means the same thing:

* a number of seconds ``> 0``: the step fails with
  ``DeadlineExceededError`` once it has run that long while a collective of
  it still waits (see :mod:`tf1_syncbn._sync.guards` for what the clock measures);
* ``0`` or ``float('inf')``: no deadline, a collective waits forever;
* finite values above :data:`MAX_TIMEOUT` (about 31 years) are clamped to it,
  so that no deadline overflows TensorFlow's or the watchdog's int64
  nanosecond clocks (``float('inf')`` used to abort every step after 0.04 s).

NaN, negative numbers, booleans and non-numbers are ``ValueError``.
"""

import contextlib
import math
import numbers
import os
import threading

__all__ = ['DEFAULT_TIMEOUT', 'MAX_TIMEOUT', 'validate_timeout', 'timeout_from_environment',
           'watched', 'op_timeout']

#: The largest finite timeout, in seconds (about 31.7 years); larger ones are clamped.
MAX_TIMEOUT = 1e9

#: The environment variable read once, at import, for :data:`DEFAULT_TIMEOUT`.
ENVIRONMENT_VARIABLE = 'TF1_SYNCBN_TIMEOUT'


def validate_timeout(value, owner, name='timeout'):
    """Checks a timeout in seconds and returns it as a float.

    Args:
      value: a number of seconds (int or float); 0 or ``float('inf')`` mean
        "wait forever".
      owner: who takes it, for the message (``'CollectiveBackend'``).
      name: the argument as the user spelled it.

    Returns:
      A float in ``[0, MAX_TIMEOUT]``: 0 for no deadline (0 or infinity),
      else ``min(value, MAX_TIMEOUT)``.

    Raises:
      ValueError: for NaN, a negative number, a bool or a non-number.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError('%s: %s must be a number of seconds (0 or float("inf") to wait '
                         'forever), got %r.' % (owner, name, value))
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError('%s: %s must be a number of seconds >= 0 (0 or float("inf") to wait '
                         'forever), got %r.' % (owner, name, value))
    if math.isinf(value):
        return 0.0
    return min(value, MAX_TIMEOUT)


def timeout_from_environment(environ=None):
    """The default timeout: ``$TF1_SYNCBN_TIMEOUT`` (seconds), or 600 when unset.

    Raises:
      ValueError: when the variable is set to something that is not a valid
        timeout (the message names the variable).
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ENVIRONMENT_VARIABLE, '').strip()
    if not text:
        return 600.0
    try:
        value = float(text)
    except ValueError:
        value = text
    return validate_timeout(value, 'tf1_syncbn', '$%s' % ENVIRONMENT_VARIABLE)


#: Seconds a step may wait in collective all-reduces before it fails with
#: ``DeadlineExceededError``: 600, or ``$TF1_SYNCBN_TIMEOUT`` (read when
#: :mod:`tf1_syncbn` is imported; 0 or ``inf`` wait forever).
#: ``CollectiveBackend(timeout=...)`` overrides it per layer.
DEFAULT_TIMEOUT = timeout_from_environment()


_LOCAL = threading.local()


@contextlib.contextmanager
def watched(flag=True):
    """Collectives built in the block are bounded by an armed step watchdog.

    :func:`op_timeout` then gives them no per-op timeout of their own (see
    :mod:`tf1_syncbn._sync.guards`, which arms the watchdog).
    """
    previous = getattr(_LOCAL, 'watched', False)
    _LOCAL.watched = bool(flag)
    try:
        yield
    finally:
        _LOCAL.watched = previous


def op_timeout(timeout):
    """The per-op ``timeout`` of a collective op being built, given the step's timeout.

    0 (none) inside :func:`watched`, where the step watchdog bounds the wait;
    ``timeout`` itself elsewhere, so that no collective is ever unbounded
    when a timeout was asked for.
    """
    return 0.0 if getattr(_LOCAL, 'watched', False) else timeout
