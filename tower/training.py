"""Helpers to build and train multi-tower TF1 graphs."""

import tensorflow as tf

from tower.context import TowerContext

__all__ = ['call_for_each_tower', 'average_gradients', 'virtual_cpu_config']


def call_for_each_tower(fn, devices, is_training=True, replicated=False):
    """Builds ``fn()`` once per device, each in its own tower.

    Tower ``i`` is built under ``tf.device(devices[i])`` and
    ``TowerContext('tower<i>', is_training, index=i, total=len(devices))``.

    Args:
      fn: a callable taking no argument; it reads the tower through
        :func:`tower.get_current_tower_context` when it needs it.
      devices: a non-empty list of device strings, such as
        ``['/gpu:0', '/gpu:1']`` or ``['/cpu:0', '/cpu:1']``.
      is_training: passed to every :class:`TowerContext`.
      replicated: if True, tower ``i`` owns its variables under the variable
        scope ``tower<i>``; otherwise towers ``> 0`` reuse tower 0's variables.

    Returns:
      The list of ``fn()`` results, one per tower, in device order.

    Raises:
      ValueError: if ``devices`` is empty, or lists the same device twice
        (two towers on one device cannot synchronize and would deadlock or
        abort a collective).
    """
    if isinstance(devices, str) or not devices:
        raise ValueError('call_for_each_tower: devices must be a non-empty list of device '
                         'strings, got %r.' % (devices,))
    canonical = [tf.DeviceSpec.from_string(d).to_string() for d in devices]
    if len(set(canonical)) != len(canonical):
        raise ValueError('call_for_each_tower: devices %r name the same device twice; give '
                         'each tower its own device.' % (list(devices),))
    results = []
    total = len(devices)
    for index, device in enumerate(devices):
        name = 'tower%d' % index
        with tf.device(device), TowerContext(
                name, is_training=is_training, index=index, total=total,
                vs_name=name if replicated else ''):
            results.append(fn())
    return results


def _as_dense(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def check_tower_grads(tower_grads, caller):
    """Checks per-tower ``(grad, var)`` lists; returns them as a list of lists.

    Args:
      tower_grads: one list of ``(gradient, variable)`` pairs per tower.
      caller: the public function's name, for messages.

    Raises:
      ValueError: when ``tower_grads`` is empty, or a tower lists other
        variables than tower 0 (or in another order).
    """
    tower_grads = [list(g) for g in tower_grads]
    if not tower_grads:
        raise ValueError('%s: tower_grads is empty.' % caller)
    first = [v for _, v in tower_grads[0]]
    for i, grads in enumerate(tower_grads[1:], 1):
        others = [v for _, v in grads]
        if len(others) != len(first) or any(a is not b for a, b in zip(others, first)):
            raise ValueError(
                '%s: tower %d lists different variables than tower 0; build every tower '
                'with the same shared variables, in the same order.' % (caller, i))
    return tower_grads


def average_gradients(tower_grads):
    """Averages gradients over towers, the classic in-graph data-parallel step.

    The loss of the whole model is taken to be the mean of the tower losses,
    so the result for each variable is ``sum_i grad_i / num_towers``. A tower
    whose gradient is None (the tower does not use the variable) contributes
    zero; a variable with a None gradient on every tower is returned with a
    None gradient, which ``Optimizer.apply_gradients`` skips.

    ``tf.IndexedSlices`` gradients stay sparse when every tower's gradient is
    sparse (values and indices are concatenated); a mix of sparse and dense is
    densified.

    Args:
      tower_grads: a list with one entry per tower; each entry is a list of
        ``(gradient, variable)`` pairs, as returned by
        ``Optimizer.compute_gradients``, with the variables in the same order
        in every tower.

    Returns:
      A list of ``(averaged_gradient, variable)`` pairs.

    Raises:
      ValueError: when ``tower_grads`` is empty or the towers list different
        variables.
    """
    tower_grads = check_tower_grads(tower_grads, 'average_gradients')
    num_towers = len(tower_grads)
    averaged = []
    with tf.name_scope('average_gradients'):
        for pairs in zip(*tower_grads):
            var = pairs[0][1]
            grads = [g for g, _ in pairs if g is not None]
            if not grads:
                averaged.append((None, var))
                continue
            scale = 1.0 / num_towers
            if all(isinstance(g, tf.IndexedSlices) for g in grads):
                values = tf.concat([g.values for g in grads], 0) * tf.cast(scale, grads[0].dtype)
                indices = tf.concat([g.indices for g in grads], 0)
                avg = tf.IndexedSlices(values, indices, grads[0].dense_shape)
            else:
                dense = [_as_dense(g) for g in grads]
                avg = tf.math.add_n(dense) * tf.cast(scale, dense[0].dtype)
            averaged.append((avg, var))
    return averaged


def virtual_cpu_config(n, **kwargs):
    """Returns a ``ConfigProto`` that exposes ``n`` virtual CPU devices.

    The devices are ``/cpu:0`` ... ``/cpu:<n-1>``; they let multi-tower graphs,
    and the collective ops that synchronize them, run and be tested on a
    machine without GPUs.

    Args:
      n: the number of CPU devices, at least 1.
      **kwargs: further ``ConfigProto`` fields, such as
        ``allow_soft_placement=True``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError('virtual_cpu_config: n must be a positive int, got %r.' % (n,))
    return tf.compat.v1.ConfigProto(device_count={'CPU': n}, **kwargs)
