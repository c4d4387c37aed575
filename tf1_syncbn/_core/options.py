"""The options of one batch-norm call, checked at graph build.

Front-ends (``sync_batch_norm``, tensorpack's ``BatchNorm``/``BatchRenorm``,
the ``tf.compat.v1.layers`` API) translate their arguments into one frozen
:class:`Options` with :func:`check_options`, and check the input with
:func:`check_inputs`. Nothing here holds data: the input tensor and the batch
weights travel as arguments of :func:`tf1_syncbn._core.call.batch_norm`.

Every error is a ``ValueError`` or ``TypeError`` that names the layer (with
its scope), the argument as the user spelled it, and what to pass instead.
"""

import collections
import numbers

import tensorflow as tf

from tf1_syncbn import backends

__all__ = ['Options', 'Layout', 'check_options', 'check_inputs', 'check_batch_weights',
           'check_dict_keys', 'replaced_layer_is_fused', 'check_graph_mode']

_FORMATS = {
    'NHWC': (True, None), 'NCHW': (False, None),
    'NDHWC': (True, 5), 'NCDHW': (False, 5),
    'channels_last': (True, None), 'channels_first': (False, None),
}
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32)
_RENORM_CLIPPING_KEYS = ('rmax', 'rmin', 'dmax')

_FIELDS = ['layer', 'arg_names', 'data_format', 'axis', 'is_training', 'momentum', 'epsilon',
           'center', 'scale', 'fused', 'renorm', 'renorm_clipping', 'renorm_momentum',
           'adjustment', 'num_dev', 'sync_statistics', 'zero_debias', 'virtual_batch_size',
           'virtual_batch_style', 'unbiased_variance', 'float32_decay', 'group_size']


class Options(collections.namedtuple('Options', _FIELDS)):
    """The checked options of one call (frozen; change with ``_replace``).

    Attributes:
      layer: the layer's name for messages, e.g. ``'sync_batch_norm(conv1/BatchNorm)'``.
      arg_names: ``{option: the user's spelling}`` (tensorpack's old names, slim's
        ``decay``), for messages.
      is_training: a Python bool or a scalar bool tensor.
      momentum, renorm_momentum: decays, a number in [0, 1] or a float32 scalar tensor.
      renorm_clipping: a dict with keys among ``rmax``, ``rmin``, ``dmax`` ({} without).
      unbiased_variance: the moving variance tracks the Bessel-corrected batch
        variance (the replaced layer runs its fused kernel), else the biased one.
      float32_decay: the replaced layer computes ``1 - decay`` in float32.
      virtual_batch_style: ``'runs'`` (tensorpack's ghost batches) or
        ``'strided'`` (tf.layers'); see :func:`tf1_syncbn._core.normalize.train`.
      group_size: None (every tower of every worker synchronizes), a positive
        int (consecutive global towers in groups of that size), or explicit
        groups as a tuple of tuples of global tower indices; see
        :func:`tf1_syncbn._sync.group.sync_groups`.
      The rest: as the layers' arguments of the same names.
    """

    def error(self, message, exc=ValueError):
        """An exception whose message starts with the layer's name."""
        return exc('%s: %s' % (self.layer, message))

    def arg(self, name):
        """The name under which the user passed the option ``name``."""
        return dict(self.arg_names).get(name, name)

    def with_replaced_path(self, fused, float32_decay=False):
        """Follows the replaced layer's path (see :func:`replaced_layer_is_fused`).

        Args:
          fused: the replaced layer runs its fused kernel here: the moving
            variance tracks the unbiased variance, otherwise the biased one.
          float32_decay: the replaced layer computes ``1 - decay`` in float32
            (Keras' fused path does), not in double.
        """
        return self._replace(unbiased_variance=bool(fused), float32_decay=bool(float32_decay))


def replaced_layer_is_fused(fused, rank, fused_ranks, unfused_options):
    """Whether the replaced layer normalizes with TensorFlow's fused kernel.

    tf-slim 1.1, tensorpack 0.11 and tf.layers each run ``tf.nn.fused_batch_norm``
    on some inputs and ``tf.nn.moments`` / ``tf.nn.batch_normalization`` on
    the others, and what they compute follows the path:

    * fused: the moving variance tracks the kernel's Bessel-corrected
      (unbiased) batch variance;
    * not fused: the moving variance tracks the biased batch variance (or
      the weighted variance, or, with renorm, ``moving_stddev``).

    The layers here keep their own (synchronized) kernels whatever the answer;
    only the tracked variance follows the replaced layer.

    Args:
      fused: the replaced layer's ``fused`` hint: None or True where a fused
        kernel applies, False never.
      rank: the input rank.
      fused_ranks: the ranks for which the replaced layer has a fused path.
      unfused_options: values of the options that no fused kernel computes
        (``batch_weights``, ``renorm``, ``adjustment``, a virtual batch): any
        of them not None and not False means the non-fused path.

    Returns:
      A Python bool.
    """
    return (fused is not False and rank in fused_ranks and
            all(option is None or option is False for option in unfused_options))


#: The function graphs of tf.cond / tf.while_loop (control flow v2), where layers may be built.
_CONTROL_FLOW_GRAPHS = ('CondBranchFuncGraph', 'WhileCondFuncGraph', 'WhileBodyFuncGraph')


def check_graph_mode(layer):
    """Raises ``RuntimeError`` eagerly or in a ``tf.function``: the layers build TF1 graphs.

    ``tf.cond`` and ``tf.while_loop`` bodies of a TF1 graph are fine; a
    function traced by ``tf.function`` (or ``tf.compat.v1.wrap_function``),
    where TensorFlow would fail with internal errors on the layers'
    variables and Python conditions, is not.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            '%s needs graph mode (TF1-style graphs, sessions and UPDATE_OPS), but eager '
            'execution is on. Call tf.compat.v1.disable_eager_execution() at the start of '
            'the program, or build the model inside `with tf.Graph().as_default():`.' % layer)
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(graph, 'building_function', False) and \
                type(graph).__name__ not in _CONTROL_FLOW_GRAPHS:
            raise RuntimeError(
                '%s is called inside a tf.function (the traced function %r): the layers build '
                'TF1-style graphs (variables created once, sessions and UPDATE_OPS), which '
                'tf.function does not support. Call it outside tf.function: build the model '
                'in graph mode (tf.compat.v1.disable_eager_execution() at the start of the '
                'program, or `with tf.Graph().as_default():`) and run it with a '
                'tf.compat.v1.Session. tf.cond and tf.while_loop inside the graph are fine.'
                % (layer, getattr(graph, 'name', graph)))
        graph = getattr(graph, 'outer_graph', None)


def check_dict_keys(layer, what, value, allowed):
    """Validates an optional dict argument; returns it (or {})."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError('%s: %s must be a dict, got %r.' % (layer, what, value))
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError('%s: unknown %s key(s) %s; allowed keys are %s.'
                         % (layer, what, unknown, list(allowed)))
    return value


def check_options(layer, arg_names=None, data_format='NHWC', axis=None, is_training=True,
                  momentum=0.99, epsilon=1e-3, center=True, scale=True, fused=None,
                  renorm=False, renorm_clipping=None, renorm_momentum=0.99, adjustment=None,
                  num_dev=None, sync_statistics=None, zero_debias=False,
                  virtual_batch_size=None, virtual_batch_style='runs', group_size=None):
    """Checks the options that do not depend on the input; returns :class:`Options`.

    ``group_size`` is checked for its type here, and refused with
    ``sync_statistics=None`` (groups of one tower each would ignore it);
    against the number of towers where the group is known
    (:func:`tf1_syncbn._sync.group.sync_groups`).

    Raises:
      ValueError, TypeError: naming the layer and the argument as spelled.
    """
    options = Options(layer, tuple(sorted((arg_names or {}).items())), data_format, axis,
                      is_training, momentum, epsilon, center, scale, fused, renorm,
                      renorm_clipping, renorm_momentum, adjustment, num_dev, sync_statistics,
                      zero_debias, virtual_batch_size, virtual_batch_style, True, False,
                      None)
    if data_format not in _FORMATS:
        raise options.error('unknown data_format %r; use one of %s.'
                            % (data_format, sorted(_FORMATS)))
    _check_number(options, 'epsilon', epsilon, 0.0, None)
    if not isinstance(is_training, bool):
        if not isinstance(is_training, (tf.Tensor, tf.Variable)) or \
                is_training.dtype.base_dtype != tf.bool or is_training.shape.ndims not in (0, None):
            raise options.error('%s must be a Python bool or a scalar bool tensor, got %r.'
                                % (options.arg('is_training'), is_training), TypeError)
    if num_dev is not None and (isinstance(num_dev, bool) or not isinstance(num_dev, int) or
                                num_dev < 1):
        raise options.error('%s must be a positive int or None, got %r.'
                            % (options.arg('num_dev'), num_dev))
    if fused not in (None, True, False):
        raise options.error('fused must be None, True or False, got %r.' % (fused,))
    if renorm:
        renorm_clipping = check_dict_keys(layer, options.arg('renorm_clipping'),
                                          renorm_clipping, _RENORM_CLIPPING_KEYS)
        _check_renorm_clipping(options, renorm_clipping)
    elif renorm_clipping:
        raise options.error('renorm_clipping is given but renorm=False; set renorm=True.')
    if adjustment is not None and not callable(adjustment):
        raise options.error('adjustment must be a callable, got %r.' % (adjustment,), TypeError)
    if virtual_batch_style not in ('runs', 'strided'):
        raise options.error("virtual_batch_style must be 'runs' or 'strided', got %r."
                            % (virtual_batch_style,))
    if virtual_batch_size is not None:
        if isinstance(virtual_batch_size, bool) or not isinstance(virtual_batch_size, int) or \
                virtual_batch_size < 1:
            raise options.error('%s must be a positive int, got %r.'
                                % (options.arg('virtual_batch_size'), virtual_batch_size))
        for option, value in (('renorm', renorm), ('adjustment', adjustment)):
            if value is not None and value is not False:
                raise options.error('%s cannot be combined with %s.'
                                    % (options.arg('virtual_batch_size'), option))
    _check_sync_statistics(options, sync_statistics)
    group_size = _check_group_size(options, group_size)
    if group_size is not None and sync_statistics is None:
        raise options.error(
            '%s=%r synchronizes within groups of towers, but %s=None normalizes each tower '
            "alone (tensorpack's default, which tf1_syncbn.BatchNorm / BatchRenorm and "
            "patch_tensorpack keep). Pass %s='auto' (or a backend) with %s, or drop %s."
            % (options.arg('group_size'), _spelled_groups(group_size),
               options.arg('sync_statistics'), options.arg('sync_statistics'),
               options.arg('group_size'), options.arg('group_size')))
    return options._replace(
        group_size=group_size,
        momentum=_check_decay(options, 'momentum', momentum),
        renorm_momentum=_check_decay(options, 'renorm_momentum', renorm_momentum),
        renorm_clipping=renorm_clipping or {})


Layout = collections.namedtuple('Layout', ['rank', 'channels_last', 'channels'])
Layout.__doc__ = """Where an input keeps its channels.

Attributes:
  rank: 2 to 5.
  channels_last: True for ``[N, ..., C]`` (always for rank 2), False for ``[N, C, ...]``.
  channels: the number of channels (static).
"""


def check_inputs(options, inputs):
    """Checks the input against the options.

    Returns:
      ``(x, layout)``: the input as a tensor, and its :class:`Layout`.

    Raises:
      TypeError: for a non-tensor or non-float input.
      ValueError: for an unknown rank, a rank outside 2..5, a layout the
        input cannot have, or an unknown channel dimension.
    """
    x = inputs
    if not isinstance(x, (tf.Tensor, tf.Variable)):
        try:
            x = tf.convert_to_tensor(x)
        except (TypeError, ValueError) as e:
            raise options.error('inputs must be a tensor (%s).' % e, TypeError)
    dtype = x.dtype.base_dtype
    if dtype not in _FLOAT_DTYPES:
        raise options.error('inputs have dtype %s; batch norm needs float16, bfloat16 or '
                            'float32 inputs (cast integers with tf.cast first).'
                            % dtype.name, TypeError)
    rank = x.shape.ndims
    if rank is None:
        raise options.error('inputs have an undefined rank; give them a static shape (for '
                            'example with tf.ensure_shape).')
    if not 2 <= rank <= 5:
        raise options.error('inputs have rank %d; batch norm supports rank 2 to 5 '
                            '([N, C] ... [N, D, H, W, C]).' % rank)
    channels_last, needs_rank = _FORMATS[options.data_format]
    if needs_rank is not None and rank != needs_rank:
        raise options.error('data_format %r needs rank-%d inputs, got rank %d; use %r.'
                            % (options.data_format, needs_rank, rank,
                               'NHWC' if channels_last else 'NCHW'))
    axis = options.axis
    if axis is not None:
        if axis not in (1, rank - 1, -1):
            raise options.error('%s=%r: only the channel axis 1 or the last axis is supported.'
                                % (options.arg('axis'), axis))
        channels_last = axis in (-1, rank - 1)
    if rank == 2:
        channels_last = True
    dims = x.shape.as_list()    # ints and None in both TF behaviours (no Dimension)
    channels = dims[-1 if channels_last else 1]
    if channels is None:
        raise options.error('the channel dimension (axis %d) of inputs %s is undefined; it '
                            'must be known at graph build to create the variables.'
                            % (-1 if channels_last else 1, x.shape))
    # (virtual_batch_size against the batch size: where the ghost batches are
    # built, which knows how many members share each virtual batch.)
    return x, Layout(rank, channels_last, int(channels))


def check_batch_weights(options, weights, x):
    """``batch_weights`` as a ``[batch]`` tensor, or None.

    Raises:
      ValueError: for another shape, or with a virtual batch.
    """
    if weights is None:
        return None
    if options.virtual_batch_size is not None:
        raise options.error('%s cannot be combined with batch_weights.'
                            % options.arg('virtual_batch_size'))
    weights = tf.convert_to_tensor(weights)
    if weights.shape.ndims not in (None, 1):
        raise options.error('batch_weights must have shape [batch], got %s.' % weights.shape)
    if not weights.shape[:1].is_compatible_with(x.shape[:1]):
        raise options.error('batch_weights shape %s does not match the batch of inputs %s.'
                            % (weights.shape, x.shape))
    return weights


def _check_sync_statistics(options, spec):
    if spec is not None and not isinstance(spec, (str, backends.SyncBackend)):
        raise options.error('%s must be None, a string or a SyncBackend, got %r.'
                            % (options.arg('sync_statistics'), spec), TypeError)
    if isinstance(spec, str) and spec.lower() not in backends.VALID_NAMES:
        raise options.error('unknown %s=%r; use one of %s or a SyncBackend.'
                            % (options.arg('sync_statistics'), spec, backends.VALID_NAMES))


def _check_group_size(options, spec):
    """``group_size``: None, a positive int, or explicit groups (as a tuple of tuples).

    Explicit groups are lists of global tower indices (worker ``w``'s tower
    ``t`` is ``w * towers_per_worker + t``), each index in exactly one group;
    whether they cover every tower is checked where the towers are known.
    """
    name = options.arg('group_size')
    if spec is None:
        return None
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        if spec < 1:
            raise options.error('%s must be a positive int, got %r.' % (name, spec))
        return int(spec)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, (list, tuple)) or not spec:
        raise options.error(
            '%s must be None, a positive int (towers per group) or a non-empty list of lists '
            'of global tower indices, got %r.' % (name, spec), TypeError)
    groups, seen = [], set()
    for members in spec:
        if isinstance(members, (str, bytes)) or not isinstance(members, (list, tuple)) or \
                not members or any(isinstance(i, bool) or not isinstance(i, numbers.Integral)
                                   or i < 0 for i in members):
            raise options.error(
                '%s: every group must be a non-empty list of global tower indices (ints >= '
                '0), got %r in %r.' % (name, members, spec), TypeError)
        twice = sorted(seen.intersection(members)) or sorted(
            i for i in set(members) if list(members).count(i) > 1)
        if twice:
            raise options.error('%s=%r puts tower%s %s in more than one group; each tower '
                                'belongs to exactly one group.'
                                % (name, spec, 's' if len(twice) > 1 else '',
                                   ', '.join(map(str, twice))))
        seen.update(members)
        groups.append(tuple(sorted(int(i) for i in members)))
    return tuple(groups)


def _spelled_groups(group_size):
    """``group_size`` as the user wrote it: an int, or explicit groups as lists."""
    if isinstance(group_size, int):
        return group_size
    return [list(members) for members in group_size]


def _check_number(options, name, value, low, high):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise options.error('%s must be a number, got %r.' % (options.arg(name), value),
                            TypeError)
    if value < low or (high is not None and value > high):
        raise options.error('%s=%r is outside [%s, %s].' % (
            options.arg(name), value, low, high if high is not None else 'inf'))


def _check_decay(options, name, value):
    """A decay: a number in [0, 1], or a float scalar tensor (as slim accepts).

    Returns:
      The number, or the tensor as float32.
    """
    if isinstance(value, (tf.Tensor, tf.Variable)):
        if not value.dtype.base_dtype.is_floating or value.shape.ndims not in (0, None):
            raise options.error('%s must be a number or a float scalar tensor, got %r.'
                                % (options.arg(name), value), TypeError)
        return tf.cast(value, tf.float32)
    _check_number(options, name, value, 0.0, 1.0)
    return value


def _check_renorm_clipping(options, clipping):
    """``0 < rmin <= 1 <= rmax`` and ``dmax >= 0`` where given as numbers."""
    limits = {'rmin': (0.0, 1.0), 'rmax': (1.0, None), 'dmax': (0.0, None)}
    for key in _RENORM_CLIPPING_KEYS:
        value = clipping.get(key)
        if value is None or isinstance(value, (tf.Tensor, tf.Variable)):
            continue  # None: no clipping; tensors are checked by nobody, as in Keras
        name = dict(options.arg_names).get(key, 'renorm_clipping[%r]' % key)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise options.error('%s must be a number or a tensor, got %r.' % (name, value),
                                TypeError)
        low, high = limits[key]
        if value < low or (key == 'rmin' and value == 0) or (high is not None and value > high):
            raise options.error('%s=%r is invalid: Batch Renormalization needs '
                                '0 < rmin <= 1 <= rmax and dmax >= 0.' % (name, value))
