"""tensorpack's rules for ``BatchNorm`` and ``BatchRenorm``.

What tensorpack (0.11) decides about a layer call before it computes
anything, in one place:

* **where the arguments come from**: explicit arguments win over
  tensorpack's ``argscope``, which wins over the defaults of an active
  :func:`~tf1_syncbn.tensorpack.patch.patch_tensorpack`
  (:func:`tensorpack_layer`, which also gives the layers the attributes
  ``argscope`` and ``LinearWrap`` look for); tensorpack's old names
  (:data:`LEGACY_NAMES`: ``use_bias``, ``decay``, ``use_local_stat``, ...)
  and the names errors use (:func:`batch_norm_arguments`,
  :func:`batch_renorm_arguments`);
* the values it takes (:data:`DATA_FORMATS`, :data:`EMA_UPDATES`), what
  ``training=None`` means (:func:`check_format_and_training`: the tower
  context's), ``BatchRenorm``'s ``rmin = 1 / rmax`` (:func:`reciprocal`);
* where its single-device layer runs TensorFlow's fused kernel
  (:func:`tensorpack_runs_fused_kernel`: which batch variance the moving
  variance tracks).

An argscope set for tensorpack's ``BatchNorm`` applies to this one too
(tensorpack keys argscopes by the layer's name). tensorpack is never imported
here: the argscope is read only when the user's program has imported it.
"""

import functools
import numbers
import sys
import threading

import tensorflow as tf

from tf1_syncbn._frontend.building import replaced_layer_is_fused
from tower import get_current_tower_context

__all__ = ['tensorpack_layer', 'LEGACY_NAMES', 'DATA_FORMATS', 'EMA_UPDATES',
           'batch_norm_arguments', 'batch_renorm_arguments', 'check_format_and_training',
           'reciprocal', 'tensorpack_runs_fused_kernel']

tf1 = tf.compat.v1

#: The layers' names (tensorpack keys argscopes and its layer registry by them).
_LAYER_NAMES = ('BatchNorm', 'BatchRenorm')
_DEFAULTS = {}          # layer name -> default keyword arguments of the active patches
_LAYERS = {}            # layer name -> this library's layer, as @tensorpack_layer wrapped it
_LOCK = threading.Lock()

#: tensorpack's old argument names -> the current ones.
LEGACY_NAMES = {
    'use_bias': 'center',
    'use_scale': 'scale',
    'gamma_init': 'gamma_initializer',
    'decay': 'momentum',
    'use_local_stat': 'training',
}
#: ``ema_update``'s values.
EMA_UPDATES = ('default', 'collection', 'internal', 'skip')
#: ``data_format``'s values -> the core's.
DATA_FORMATS = {'channels_last': 'NHWC', 'NHWC': 'NHWC', 'channels_first': 'NCHW',
                'NCHW': 'NCHW', 'NDHWC': 'NHWC', 'NCDHW': 'NCHW'}


def _argscope_kwargs(name):
    module = sys.modules.get('tensorpack.tfutils.argscope')
    if module is None:
        return {}
    return dict(module.get_arg_scope()[name])


def tensorpack_layer(func):
    """Gives a tensorpack-style layer ``func(name, inputs, ...)`` tensorpack's layer API.

    The wrapped layer reads tensorpack's ``argscope`` (when tensorpack is
    imported) and the defaults of an active :func:`patch_tensorpack`, and has
    the attributes that tensorpack's ``argscope`` and ``LinearWrap`` look for
    (``__argscope_enabled__``, ``use_scope``).
    """
    @functools.wraps(func)
    def layer(*args, **kwargs):
        with _LOCK:
            merged = dict(_DEFAULTS.get(func.__name__, {}))
        merged.update(_argscope_kwargs(func.__name__))
        merged.update(kwargs)
        return func(*args, **merged)

    layer.__argscope_enabled__ = True
    layer.use_scope = True
    _LAYERS[func.__name__] = layer
    return layer


class Default(object):
    """A keyword's default that the caller left out, so that an old name may still set it.

    ``BatchNorm(momentum=...)`` and ``BatchNorm(decay=...)`` are one option:
    passing both is an error, which needs to know whether ``momentum`` was
    passed. Its repr is the default's, so signatures read as tensorpack's.
    """

    def __init__(self, text):
        self._text = text

    def __repr__(self):
        return self._text


def _unset(value):
    return isinstance(value, Default)


_UNSET = Default('<unset>')
#: ``BatchNorm``'s defaults that an old name may set (the values are tensorpack's).
DEFAULT_MOMENTUM, DEFAULT_CENTER, DEFAULT_SCALE = Default('0.9'), Default('True'), Default('True')
DEFAULT_GAMMA_INITIALIZER = Default('ones_initializer()')


def _apply_legacy_names(layer, kwargs, current):
    """Maps tensorpack's old keyword names onto ``current`` (a dict of defaults).

    Returns:
      ``{current name: old name}`` for the options passed under an old name
      (error messages name the argument as the user spelled it).
    """
    spelled = {}
    for old, value in kwargs.items():
        if old not in LEGACY_NAMES:
            raise TypeError('%s got an unexpected keyword argument %r.' % (layer, old))
        new = LEGACY_NAMES[old]
        if new not in current:
            raise TypeError('%s does not take %r.' % (layer, old))
        if not _unset(current[new]):
            raise TypeError('%s: pass either %r or its old name %r, not both.'
                            % (layer, new, old))
        current[new] = value
        spelled[new] = old
    return spelled


def batch_norm_arguments(layer, legacy_kwargs, training, **passed):
    """``BatchNorm``'s arguments with tensorpack's old names and defaults applied.

    Args:
      layer: the layer's name for messages.
      legacy_kwargs: the keyword arguments passed under old names.
      training: the ``training`` argument.
      **passed: ``momentum``, ``center``, ``scale``, ``gamma_initializer`` as
        passed (a :class:`Default` where left out).

    Returns:
      ``(values, training, arg_names)``: ``passed`` with the old names' values
      and tensorpack's defaults; ``training`` (``use_local_stat``'s value);
      ``{core option: the user's spelling}`` for the errors.

    Raises:
      TypeError: an unknown keyword, or an option passed under both names.
    """
    values = dict(passed, training=_UNSET)
    spelled = _apply_legacy_names(layer, legacy_kwargs, values)
    spelled['is_training'] = spelled.pop('training', 'training')
    local_stat = values.pop('training')
    if not _unset(local_stat):
        if training is not None:
            raise TypeError("%s: pass either 'training' or 'use_local_stat', not both." % layer)
        training = local_stat
    defaults = {'momentum': 0.9, 'center': True, 'scale': True,
                'gamma_initializer': tf1.ones_initializer()}
    for key, value in defaults.items():
        if _unset(values[key]):
            values[key] = value
    return values, training, spelled


def batch_renorm_arguments(layer, legacy_kwargs, **passed):
    """``BatchRenorm``'s arguments with tensorpack's old names applied.

    Args:
      layer: the layer's name for messages.
      legacy_kwargs: the keyword arguments passed under old names.
      **passed: ``momentum``, ``center``, ``scale``, ``gamma_initializer``
        (an old name's value takes their place).

    Returns:
      ``(values, arg_names)``, as :func:`batch_norm_arguments`.

    Raises:
      TypeError: an unknown keyword.
    """
    values = {key: _UNSET for key in passed}
    spelled = _apply_legacy_names(layer, legacy_kwargs, values)
    for key, value in passed.items():
        if _unset(values[key]):
            values[key] = value
    return values, dict(spelled, is_training='training', rmax='rmax', dmax='dmax',
                        rmin='1 / rmax')


def check_format_and_training(layer, data_format, training):
    """Validates ``data_format``; resolves ``training=None`` from the tower context.

    Returns:
      ``(the tower context or None, training)``.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError('%s: unknown data_format %r; use one of %s.'
                         % (layer, data_format, sorted(DATA_FORMATS)))
    ctx = get_current_tower_context()
    if training is None:
        training = ctx.is_training if ctx is not None else True
    return ctx, training


def reciprocal(rmax):
    """``rmin = 1 / rmax`` as tensorpack sets it (None for an invalid rmax: its check fails)."""
    if isinstance(rmax, (tf.Tensor, tf.Variable)):
        return tf.math.reciprocal(tf.cast(rmax, tf.float32))
    if isinstance(rmax, numbers.Real) and not isinstance(rmax, bool) and rmax > 0:
        return 1.0 / rmax
    return None


def tensorpack_runs_fused_kernel(rank, dtype, virtual_batch_size):
    """Where tensorpack 0.11's single-device ``BatchNorm`` runs the fused kernel.

    tensorpack builds ``tf.layers.BatchNormalization(fused=(ndims == 4))``,
    with ``fused=True`` forced for float16 inputs, and Keras fuses rank 4 and
    5 only; a virtual batch takes tensorpack's own ``tf.nn.moments`` path. So:
    rank 4 (and float16 rank 5) is fused, rank 2 (and 3, 5, which tensorpack
    rejects, taken as its code would treat them) is not.

    tensorpack's *synchronized* path tracks the biased ``E[x^2] - E[x]^2`` even
    on rank 4; the layers here follow its single-device path instead, so that
    N synchronized towers equal one device.

    Returns:
      See :func:`tf1_syncbn._core.options.replaced_layer_is_fused`.
    """
    hint = rank == 4 or dtype == tf.float16
    return replaced_layer_is_fused(hint, rank, (4, 5), (virtual_batch_size,))
