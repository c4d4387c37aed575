"""The runner's switches: every batch-norm API the library covers, switched to its layers.

The start-up hook (:mod:`tf1_syncbn.run.startup`) calls :func:`activate` once
TensorFlow and the package's own imports are fully imported, and
:func:`library_loaded` when tensorpack or Keras 2 is imported later. Each
switch is the front-end's own public patch, made inside
:func:`tf1_syncbn._frontend.patching.yielding`, so that a script that calls the
patch itself keeps working with its own arguments while its patch is active:

* tf.layers (tf-keras' layer without the runner, none on Keras 3; per tower):
  :func:`tf1_syncbn.patch_tf_layers`;
* tf-slim (``slim.batch_norm``, per tower): :func:`tf1_syncbn.patch_slim`;
* Keras 2 (tf-keras' layer, per tower): :func:`tf1_syncbn.keras.patch_keras`,
  once its package is imported;
* tensorpack (its ``BatchNorm``, ``sync_statistics=None``: per tower):
  :func:`tf1_syncbn.patch_tensorpack`, once tensorpack is imported;

with the same defaults for all: ``sync_statistics`` from ``--backend``
(``'auto'``, tensorpack's included: the runner is there to synchronize;
``none``: per-tower statistics), ``num_dev`` from ``--num-dev`` and
``group_size`` from ``--group-size``. The library's own layers called by the
script keep the script's arguments. A front-end whose patch fails is reported
(stderr, and ``NOT SWITCHED`` in each report); the others are switched.
"""

import inspect
import sys

from tf1_syncbn._frontend.patching import keras2_package, yielding
from tf1_syncbn.layers import patch_tf_layers
from tf1_syncbn.run import proof
from tf1_syncbn.run.report import Switch
from tf1_syncbn.run.startup import parse_environment
from tf1_syncbn.slim import patch_slim
from tf1_syncbn.tensorpack import BatchNorm, patch_tensorpack

__all__ = ['activate', 'library_loaded', 'defaults', 'tensorpack_defaults', 'switches']

#: The front-ends, in the report's order.
FRONT_ENDS = ('tf.layers', 'tf-slim', 'Keras 2', 'tensorpack')
_STATE = {'options': None, 'switches': {}}


def switches():
    """``{front-end: Switch}``: what the runner did with each front-end so far."""
    return dict(_STATE['switches'])


def defaults(options):
    """The layers' defaults under the runner: ``sync_statistics``, ``num_dev``, ``group_size``."""
    return {'sync_statistics': None if options.backend == 'none' else options.backend,
            'num_dev': options.num_dev, 'group_size': options.group_size}


def tensorpack_defaults(options, patch=patch_tensorpack, layer=BatchNorm):
    """:func:`defaults` for :func:`tf1_syncbn.patch_tensorpack`, as far as it takes them.

    ``num_dev`` and ``group_size`` are passed when given; each must be an
    argument of the patch or of ``tf1_syncbn.BatchNorm``.

    Raises:
      ValueError: when ``--num-dev`` or ``--group-size`` is given and this
        version's tensorpack layer has no such argument, naming what to do.
    """
    result = defaults(options)
    accepted = set(inspect.signature(patch).parameters) | set(inspect.signature(layer).parameters)
    for name in ('num_dev', 'group_size'):
        if result[name] is None:
            del result[name]
        elif name not in accepted:
            flag = '--' + name.replace('_', '-')
            raise ValueError(
                'tf1_syncbn.run: %s cannot reach tensorpack\'s BatchNorm: this version\'s '
                'tf1_syncbn.BatchNorm and patch_tensorpack take no %s. tensorpack\'s trainers '
                'give its layers their towers: run without %s, or call tf1_syncbn.BatchNorm '
                'in tower.TowerContext towers.' % (flag, name, flag))
    return result


def _switch(front_end, make, values):
    """Makes one front-end's patch (yielding), and records what happened."""
    switch = Switch(front_end, defaults=values)
    try:
        with yielding():
            make()
    except Exception as e:  # noqa: BLE001 - reported; the audit shows what it leaves unsynced
        switch.status, switch.error = 'failed', '%s: %s' % (type(e).__name__, e)
        sys.stderr.write('tf1_syncbn.run: %s is NOT switched to tf1_syncbn\'s layers: %s\n'
                         % (front_end, switch.error))
    else:
        switch.status = 'switched'
    _STATE['switches'][front_end] = switch
    _refresh()


def _refresh():
    """The report's list of switches, in :data:`FRONT_ENDS` order (shared with :mod:`proof`)."""
    table = _STATE['switches']
    _STATE['list'][:] = [table.get(f) or Switch(f) for f in FRONT_ENDS]


def activate(text, loading=frozenset()):
    """Switches every front-end whose library is imported, and installs the proof.

    Args:
      text: the runner's options (``TF1_SYNCBN_RUN``'s value).
      loading: the modules whose import is still running (switched later,
        by :func:`library_loaded`).
    """
    options = parse_environment(text)
    _STATE['options'] = options
    _STATE['list'] = []
    _refresh()
    proof.install(options, _STATE['list'])
    values = defaults(options)
    _switch('tf.layers', lambda: patch_tf_layers(**values), values)
    _switch('tf-slim', lambda: patch_slim(**values), values)
    for name in ('tf_keras', 'tensorpack'):
        library_loaded(name, loading)


def library_loaded(name, loading=frozenset()):
    """Switches Keras 2 or tensorpack once its package is imported (``name``: its module).

    Raises:
      ValueError: see :func:`tensorpack_defaults` (the script's ``import
        tensorpack`` raises it).
    """
    options = _STATE['options']
    table = _STATE['switches']
    if name in ('keras', 'tf_keras') and 'Keras 2' not in table:
        package = keras2_package()
        if package in sys.modules and package not in loading:
            from tf1_syncbn.keras import patch_keras  # noqa: PLC0415 - imports tf-keras
            values = defaults(options)
            _switch('Keras 2', lambda: patch_keras(**values), values)
    elif name == 'tensorpack' and 'tensorpack' not in table:
        if 'tensorpack' in sys.modules and 'tensorpack' not in loading:
            values = tensorpack_defaults(options)
            _switch('tensorpack', lambda: patch_tensorpack(**values), values)
