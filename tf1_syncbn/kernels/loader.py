"""The compiled library in this process: whether the layers use it, loading it, its status.

``TF1_SYNCBN_KERNELS=0`` (read once, at import) leaves the library out
altogether; :func:`use_custom_kernels` switches the layers' compute kernels off
and on for the layers built in a block, while the step watchdog
(``SyncBnStepWatchdog``) still comes from the library (:func:`library`).
"""

import contextlib
import os
import threading
import warnings

import tensorflow as tf

from tf1_syncbn.kernels import cache

__all__ = ['enabled', 'use_custom_kernels', 'load', 'library', 'register_cached', 'status',
           'OP_TYPE_PREFIX']

_LOCK = threading.Lock()
_STATE = {'module': None, 'tried': False, 'error': None}
_ALLOWED = os.environ.get('TF1_SYNCBN_KERNELS', '1') != '0'   # build and load the library
_ENABLED = [_ALLOWED]                                           # the layers use its kernels
_OP_TYPES = ('SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput')
#: What every op type of the compiled library starts with (the four kernels
#: above and the step watchdog, ``SyncBnStepWatchdog``).
OP_TYPE_PREFIX = 'SyncBn'


def enabled():
    """Whether layers built now may use the custom kernels."""
    return _ENABLED[0]


@contextlib.contextmanager
def use_custom_kernels(flag):
    """Builds layers with (True) or without (False) the custom kernels in the block."""
    previous = _ENABLED[0]
    _ENABLED[0] = bool(flag)
    try:
        yield
    finally:
        _ENABLED[0] = previous


def load():
    """The compiled op module for the layers' compute, or None when unavailable or disabled.

    The first call in a process compiles them if the cache does not have them
    yet. When that fails, it warns once and the layers use the stock kernels.
    ``TF1_SYNCBN_KERNELS=0`` (or :func:`use_custom_kernels`) disables them.
    """
    if not enabled():
        return None
    return library()


def library():
    """The compiled op module whether or not the compute kernels are enabled, or None.

    It also holds the step watchdog (``SyncBnStepWatchdog``), which the
    collective backend uses wherever the library can be built. None with
    ``TF1_SYNCBN_KERNELS=0`` or when building fails (warned once).
    """
    if not _ALLOWED:
        return None
    with _LOCK:
        if not _STATE['tried']:
            _STATE['tried'] = True
            try:
                _load(cache.build())
            except Exception as e:  # noqa: BLE001 - any failure means: use stock kernels
                _STATE['error'] = e
                warnings.warn("tf1_syncbn: custom CPU kernels unavailable (%s); using "
                              "TensorFlow's stock kernels (same results, slower) and "
                              "TensorFlow's per-op collective timeouts (two threads per "
                              "collective while it runs)." % e, RuntimeWarning, stacklevel=2)
        return _STATE['module']


def _load(path):
    """Loads the library at ``path`` (registering its ops) as this process's module."""
    module = tf.load_op_library(path)
    for op_type in _OP_TYPES:
        # Statistics and gradient kernels: the engine differentiates the
        # step as a whole (tf.custom_gradient); no path goes through them.
        tf.no_gradient(op_type)
    _STATE['module'] = module
    return module


def register_cached():
    """Registers the library's ops when a build for this TensorFlow is cached; compiles nothing.

    ``import tf1_syncbn`` calls it, so that a graph built with the compiled
    kernels or the step watchdog (a meta graph, a ``GraphDef``) loads in a
    new process without building a layer first. It neither runs nor probes a
    compiler: with no cached build (``python -m tf1_syncbn.kernels`` makes
    one), or with ``TF1_SYNCBN_KERNELS=0``, it does nothing, and a failed
    load is left for :func:`library` to report.

    Returns:
      Whether the library is loaded now.
    """
    if not _ALLOWED:
        return False
    with _LOCK:
        if _STATE['tried']:
            return _STATE['module'] is not None
        cached = cache.cached_builds()
        if not cached:
            return False
        try:
            _load(cached[0][0])
        except Exception:  # noqa: BLE001 - library() retries, and warns
            return False
        _STATE['tried'] = True
        return True


def status():
    """A one-line description of the kernels in use, for diagnostics."""
    module = load()
    if module is not None:
        return 'custom CPU kernels (%s)' % cache.cache_path()
    if not enabled():
        return 'stock kernels (custom kernels disabled)'
    return 'stock kernels (%s)' % (_STATE['error'],)
