"""Independent references: float64 numpy batch norm, and helpers to build towers.

Nothing here uses the code under test for the expected values.
"""

import numpy as np
import tensorflow as tf

from tower import call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1


def to_channels_last(x, channels_last):
    """Moves the channel axis of a numpy array to the end."""
    if channels_last or x.ndim == 2:
        return x
    return np.moveaxis(x, 1, -1)


def from_channels_last(x, channels_last):
    if channels_last or x.ndim == 2:
        return x
    return np.moveaxis(x, -1, 1)


def bn_forward(x, gamma, beta, eps, channels_last=True, weights=None):
    """Float64 batch norm over every axis but the channel axis.

    Returns:
      dict with y, mean, var (biased), var_unbiased, n, xhat (channels last).
    """
    xl = to_channels_last(np.asarray(x, np.float64), channels_last)
    c = xl.shape[-1]
    flat = xl.reshape(-1, c)
    if weights is None:
        w = np.ones(flat.shape[0])
    else:
        per = flat.shape[0] // max(len(weights), 1) if len(weights) else 0
        w = np.repeat(np.asarray(weights, np.float64), per)
    n = w.sum()
    mean = (w[:, None] * flat).sum(0) / n
    var = (w[:, None] * (flat - mean) ** 2).sum(0) / n
    xhat = (xl - mean) / np.sqrt(var + eps)
    y = xhat * gamma + beta
    count = flat.shape[0]
    return dict(y=from_channels_last(y, channels_last), mean=mean, var=var,
                var_unbiased=var * count / max(count - 1, 1), n=n, xhat=xhat)


def bn_backward(dy, x, gamma, eps, channels_last=True):
    """Float64 gradients of ``sum(bn_forward(x).y * dy)`` (unweighted)."""
    dyl = to_channels_last(np.asarray(dy, np.float64), channels_last)
    fwd = bn_forward(x, gamma, np.zeros_like(gamma), eps, channels_last)
    c = dyl.shape[-1]
    xhat = fwd['xhat']
    n = xhat.size // c
    dbeta = dyl.reshape(-1, c).sum(0)
    dgamma = (dyl * xhat).reshape(-1, c).sum(0)
    dx = gamma / np.sqrt(fwd['var'] + eps) * (dyl - dbeta / n - xhat * dgamma / n)
    return dict(dx=from_channels_last(dx, channels_last), dgamma=dgamma, dbeta=dbeta)


def split_batches(x, sizes):
    """Splits ``x`` along axis 0 into pieces of the given sizes."""
    out, start = [], 0
    for s in sizes:
        out.append(x[start:start + s])
        start += s
    return out


def build_towers(layer_fn, num_towers, shape, dtype=tf.float32):
    """Builds ``layer_fn(x)`` on ``num_towers`` virtual CPU towers (see build_towers_on)."""
    return build_towers_on(layer_fn, ['/cpu:%d' % i for i in range(num_towers)], shape, dtype)


def build_towers_on(layer_fn, devices, shape, dtype=tf.float32):
    """Builds ``layer_fn(x)`` once per device.

    Each tower gets a placeholder with an unknown batch size and an upstream
    gradient placeholder; the loss is ``sum_i sum(y_i * dy_i)`` so that
    ``tf.gradients`` returns the global gradients.

    Returns:
      dict with xs, dys (placeholders), ys, loss.
    """
    xs, dys, ys = [], [], []

    def tower():
        i = get_current_tower_context().index
        x = tf1.placeholder(tf.float32, [None] + list(shape[1:]), name='x%d' % i)
        dy = tf1.placeholder(tf.float32, [None] + list(shape[1:]), name='dy%d' % i)
        y = layer_fn(tf.cast(x, dtype))
        xs.append(x)
        dys.append(dy)
        ys.append(y)
        return y

    call_for_each_tower(tower, devices)
    loss = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32) * dy) for y, dy in zip(ys, dys)])
    return dict(xs=xs, dys=dys, ys=ys, loss=loss)


def towers_skipping_a_layer(backend, layer=None, **layer_kwargs):
    """Two towers that build one synchronized layer; tower 1 skips it at run time.

    Every tower builds the layer (the build-time and first-run checks see a
    complete group), but a ``tf.cond`` runs it in tower 0 only: the all-reduce
    waits for tower 1 until the backend's timeout. The default layer is built
    in name-scope towers (``num_dev=2``), a given one in ``TowerContext``s.

    Args:
      backend: the layer's ``sync_statistics``.
      layer: ``layer(x, backend)`` builds the synchronized layer on ``x`` (of
        shape ``[None, 4, 3]`` when given); default: ``sync_batch_norm`` on
        ``[None, 3]`` with ``**layer_kwargs``.

    Returns:
      ``(xs, ys)``: the towers' placeholders and outputs.
    """
    from tf1_syncbn import sync_batch_norm
    from tower import TowerContext
    xs, ys = [], []
    for i in range(2):
        tower = tf.name_scope('tower%d' % i) if layer is None else \
            TowerContext('tower%d' % i, index=i, total=2)
        with tf.device('/cpu:%d' % i), tower:
            x = tf1.placeholder(tf.float32, [None, 3] if layer is None else [None, 4, 3])
            xs.append(x)
            if layer is None:
                build = lambda: sync_batch_norm(  # noqa: E731
                    x, num_dev=2, scope='bn', reuse=tf1.AUTO_REUSE,  # noqa: B023
                    updates_collections=None, sync_statistics=backend, **layer_kwargs)
            else:
                build = lambda: layer(x, backend)  # noqa: E731,B023
            ys.append(tf.cond(tf.constant(i == 0), build, lambda: x))  # noqa: B023
    return xs, ys


def count_ops(graph, op_type):
    return sum(1 for op in graph.get_operations() if op.type == op_type)


def var(name):
    """The global variable whose op name is ``name``."""
    found = [v for v in tf1.global_variables() if v.op.name == name]
    if len(found) != 1:
        raise KeyError('no unique variable %r in %s' % (name, [v.op.name for v in
                                                             tf1.global_variables()]))
    return found[0]
