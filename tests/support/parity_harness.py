"""One parity case: a batch-norm layer trained on N towers, every number recorded.

The parity tests run the same function on both sides: in a subprocess with
tf-slim 1.1 / tensorpack 0.11 themselves on one device (see
``legacy_reference.py``), and in the test process with this library on one
tower and on N towers. It never imports ``tf1_syncbn``: the layer comes in as
a function, so the reference side is independent of the code under test.

A case is a JSON-able dict:

* ``shape``: the global batch's shape (batch first);
* ``sizes``: the per-tower batch sizes of the N-tower run (default
  ``[3, 0, 5]``: uneven, one tower empty);
* ``interleave``: ghost batch norm with N members: tower ``t`` holds the
  ``t``-th run of ``virtual_batch_size / N`` examples of every virtual batch
  (the reference batch is the interleaved concatenation);
* ``training_tensor``: ``is_training`` / ``training`` is a bool placeholder;
* ``loc``, ``scale``: the data's mean and spread (default 1 and 2);
* ``learning_rate``: of the SGD steps (default ``LEARNING_RATE``);
* ``dtype``: ``'float16'`` or ``'bfloat16'``: the layer gets its input cast
  to that type (data and gradients are fed as float32 on both sides, so both
  see the same rounded inputs);
* the rest (``kwargs``, ...) is read by the test's layer function.

Each step feeds new data and runs one SGD step on ``sum(y * dy)``, with the
update ops of ``UPDATE_OPS`` as control dependencies of the train op.
"""

import types

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

STEPS = 3
LEARNING_RATE = 0.1
DEFAULT_SIZES = [3, 0, 5]


def case_data(case, index):
    """Inputs, upstream gradients and batch weights of every step (numpy, float32)."""
    rng = np.random.RandomState(1000 + index)
    shape = case['shape']
    loc, scale = case.get('loc', 1.0), case.get('scale', 2.0)
    data = {}
    for step in range(STEPS):
        data['x/%d' % step] = (rng.randn(*shape) * scale + loc).astype(np.float32)
        data['dy/%d' % step] = rng.randn(*shape).astype(np.float32)
        weights = rng.uniform(0.0, 2.0, shape[0]).astype(np.float32)
        if case.get('integer_weights'):   # 1, 2 or 3: a weight is a number of copies
            weights = np.floor(weights * 1.5) + 1
        else:
            weights[1] = 0.0
        data['w/%d' % step] = weights
    data['x/eval'] = (rng.randn(*shape) * scale + loc).astype(np.float32)
    return data


def tower_rows(case, sizes):
    """The rows of the reference batch that each tower holds."""
    total = case['shape'][0]
    if case.get('interleave') and len(sizes) > 1:
        vbs = case['kwargs']['virtual_batch_size']
        per = vbs // len(sizes)
        return [np.concatenate([np.arange(k * vbs + t * per, k * vbs + (t + 1) * per)
                                for k in range(total // vbs)]) for t in range(len(sizes))]
    assert sum(sizes) == total, (sizes, total)
    starts = np.cumsum([0] + list(sizes))
    return [np.arange(starts[i], starts[i + 1]) for i in range(len(sizes))]


#: The compiled CPU kernels of tf1_syncbn (what tells the kernel sets apart in a graph).
CUSTOM_KERNEL_OPS = ('SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput')


def graph_info(graph):
    """Names of what a drop-in replacement must name as the replaced layer does.

    Also ``kernel_ops``: how many ops of the compiled kernel set the graph holds.
    """
    def name(op):
        return getattr(op, 'op', op).name

    ops = graph.get_operations()
    with graph.as_default():
        return {
            'kernel_ops': sum(1 for op in ops if op.type in CUSTOM_KERNEL_OPS),
            'fused_ops': sorted(op.name for op in ops if op.type == 'FusedBatchNormV3'),
            'assign_ops': sorted(op.name for op in ops
                                 if 'Assign' in op.type and not op.name.endswith('/Assign')),
            'update_ops': [name(op) for op in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)],
            'model_variables': sorted(v.op.name for v in tf1.model_variables()),
            'global_variables': sorted(v.op.name for v in tf1.global_variables()),
            'trainable_variables': sorted(v.op.name for v in tf1.trainable_variables()),
        }


def train_case(apply, case, index, sizes):
    """Builds ``apply`` on ``len(sizes)`` towers and trains ``STEPS`` SGD steps.

    Args:
      apply: ``apply(x, weights, training, tower, towers)`` builds the layer on
        ``x`` (``tower`` is None for the inference call, built after the
        towers, which must reuse the variables) and returns its output.
      case: the case dict.
      index: the case's index (seeds its data).
      sizes: per-tower batch sizes; one tower is built without any tower
        context, more in ``tower.TowerContext`` on virtual CPUs.

    Returns:
      ``(arrays, info)``: arrays keyed ``y/<step>``, ``dx/<step>``,
      ``grad/<step>/<variable>``, ``var/<step>/<variable>`` (after the step) and
      ``eval`` (inference on the final statistics), with rows in the reference
      batch's order; and :func:`graph_info`.
    """
    rows = tower_rows(case, sizes)
    graph = tf.Graph()
    with graph.as_default():
        net = build_towers(apply, case, len(sizes))
        variable_grads = net.grads[len(sizes):]
        train = sgd_step(case, net, variable_grads)
        info = graph_info(graph)
        arrays = run_steps(net, train, variable_grads, case_data(case, index), rows,
                           lambda parts: _unsplit(parts, rows))
    return arrays, info


def build_towers(apply, case, towers):
    """One run's towers of ``apply``, its inference call and the gradients, in the default graph.

    Args:
      apply: as :func:`train_case`'s.
      case: the case dict.
      towers: how many towers: one is built without any tower context, more
        in ``tower.TowerContext`` on virtual CPUs (``/cpu:<i>``).

    Returns:
      A namespace: ``training`` (True, or a bool placeholder with
      ``case['training_tensor']``); per tower, the placeholders ``xs`` (input),
      ``dys`` (upstream gradient), ``ws`` (batch weights) and the output
      ``ys``; ``x_eval`` and ``y_eval`` (the inference call); ``variables``
      (the trainable ones); ``grads``: the gradients of ``sum(y * dy)`` with
      respect to ``xs``, then ``variables`` (this graph's towers only).
    """
    shape = [None] + list(case['shape'][1:])
    dtype = tf.as_dtype(case.get('dtype', 'float32'))
    training = tf1.placeholder(tf.bool, [], 'training') if case.get('training_tensor') else True
    xs, dys, ws, ys = [], [], [], []

    def tower(i):
        x = tf1.placeholder(tf.float32, shape, 'x')
        dy = tf1.placeholder(tf.float32, shape, 'dy')
        w = tf1.placeholder(tf.float32, [None], 'weights')
        xs.append(x)
        dys.append(dy)
        ws.append(w)
        ys.append(apply(tf.cast(x, dtype), w, training, i, towers))

    if towers == 1:
        tower(0)
    else:
        from tower import TowerContext  # noqa: PLC0415 - only the N-tower side
        for i in range(towers):
            with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=towers):
                tower(i)
    x_eval = tf1.placeholder(tf.float32, shape, 'x_eval')
    y_eval = apply(tf.cast(x_eval, dtype), None, False, None, towers)
    loss = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32) * dy) for y, dy in zip(ys, dys)])
    variables = tf1.trainable_variables()
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
             for g in tf.gradients(loss, xs + variables)]   # (through tf.gather: sparse)
    return types.SimpleNamespace(training=training, xs=xs, dys=dys, ws=ws, ys=ys,
                                 x_eval=x_eval, y_eval=y_eval, variables=variables, grads=grads)


def sgd_step(case, net, variable_grads):
    """The train op: one SGD step of ``net.variables`` by ``variable_grads``, with ``UPDATE_OPS``.

    ``variable_grads``: ``net``'s own (one process), or their sum over processes.
    """
    # The step applies SGD after every fetched output and gradient is computed:
    # in TF1 behaviour (reference variables) a read aliases the variable, and
    # the replaced layers' non-fused paths (tf-slim's, tf.layers') read gamma
    # again in their backward pass, so an update of gamma running first would
    # change their input gradient (this library copies its reads:
    # test_read_races.py).
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) +
                                 [tf.group(net.ys + net.grads)]):
        if not net.variables:
            return tf.no_op()
        return tf1.train.GradientDescentOptimizer(
            case.get('learning_rate', LEARNING_RATE)).apply_gradients(
            list(zip(variable_grads, net.variables)))


def run_steps(net, train, variable_grads, data, rows, join, start=()):
    """Runs ``STEPS`` steps of ``train`` and the inference call, in a new session of the graph.

    Args:
      net: :func:`build_towers`' namespace.
      train: :func:`sgd_step`'s op.
      variable_grads: the parameter gradients recorded (as :func:`sgd_step`'s).
      data: :func:`case_data`'s arrays.
      rows: the rows of ``data`` each tower is fed.
      join: ``join(parts)``: the towers' parts of an output or input gradient
        as one array.
      start: ops run once after the variables are initialized.

    Returns:
      The arrays :func:`train_case` describes (``y`` and ``dx`` as ``join``
      puts them).
    """
    towers = len(net.xs)
    arrays = {}
    with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': towers})) as sess:
        sess.run(tf1.global_variables_initializer())
        for op in start:
            sess.run(op)
        for step in range(STEPS):
            feed = {}
            for i in range(towers):
                feed[net.xs[i]] = data['x/%d' % step][rows[i]]
                feed[net.dys[i]] = data['dy/%d' % step][rows[i]]
                feed[net.ws[i]] = data['w/%d' % step][rows[i]]
            if net.training is not True:
                feed[net.training] = True
            y_parts, dx_parts, grad_values, _ = sess.run(
                [net.ys, net.grads[:towers], variable_grads, train], feed)
            arrays['y/%d' % step] = join(y_parts)
            arrays['dx/%d' % step] = join(dx_parts)
            for v, g in zip(net.variables, grad_values):
                arrays['grad/%d/%s' % (step, v.op.name)] = g
            everything = tf1.global_variables()   # one run: one executor, not one each
            for v, value in zip(everything, sess.run(everything)):
                arrays['var/%d/%s' % (step, v.op.name)] = value
        feed = {net.x_eval: data['x/eval']}
        if net.training is not True:
            feed[net.training] = False
        arrays['eval'] = np.asarray(sess.run(net.y_eval, feed), np.float32)
    return arrays


def _unsplit(parts, rows):
    """Puts per-tower rows back at their places in the reference batch (as float32).

    float16 and bfloat16 values are exact in float32 (and bfloat16 has no
    numpy type of its own that ``np.savez`` keeps).
    """
    out = np.zeros((sum(len(r) for r in rows),) + parts[0].shape[1:], np.float32)
    for part, r in zip(parts, rows):
        out[r] = part
    return out


#: One unit in the last place at 1 (the spacing of values in [1, 2)).
HALF_EPS = {'float16': 2.0 ** -10, 'bfloat16': 2.0 ** -7}
FLOAT32_EPS = 2.0 ** -23


def is_statistic(key):
    """Whether ``key`` is a moving statistic (slim's ``moving_*``, tensorpack's ``*/EMA``)."""
    return 'moving' in key or key.endswith('/EMA')


def tolerances(key, case):
    """``(rtol, atol relative to the array's magnitude)`` for one array of a case.

    Float32: ``1e-5`` relative for outputs and variables, ``1e-4`` for
    gradients (sums over the batch); ``case['tight']`` checks the moving
    statistics to ``2e-6`` (what tells ``1 - decay`` in float32 from double at
    decay 0.999); ``case['tolerance']`` scales them all.

    float16 / bfloat16 (``case['dtype']``): the outputs (``y``, ``eval``) and
    the input gradient (``dx``) are values of that type. slim and tensorpack
    compute them in float32 from the same rounded inputs (fused kernels, and
    Keras' non-fused path, which casts 16-bit inputs to float32) and round
    once at the end; where two float32 computations differ by a rounding
    error, the results can land one unit in the last place apart: ``eps`` of
    the type (``2^-10``, ``2^-7``) relative to the array's largest value, plus
    ``eps`` relative to the value itself (so up to 2 units near the largest).
    Everything else (statistics, variables, parameter gradients) is float32 in
    the reference and keeps the float32 tolerances.

    Inputs whose mean is far from zero (``case['loc'] / case['scale']``, 10^4
    in the large-mean cases): the reference holds the batch mean in float32,
    which rounds it to ``eps32 * |loc|`` (1.2e-3 spreads at 10^4), and sums
    it in float32 (measured against float64: slim's normalized values are off
    by up to a few of those units, this library's by 0.15; slim's weighted
    moments more). Everything computed from the normalized values gets
    ``4 * eps32 * |loc| / scale`` (0.5% at 10^4) of its magnitude; the
    gradient of ``gamma``, ``sum(dy * xhat)``, is off by the per-channel
    offset of ``xhat`` times ``sum(dy)``, so its magnitude includes that of the
    gradient of ``beta`` (see :func:`assert_same_numbers`). Those cases train
    with learning rate 0, so that this does not compound through the SGD
    steps' ``gamma`` and ``beta`` (measured: the differences stay below
    half of this tolerance). The moving statistics keep the float32
    tolerances: the two-pass variance is insensitive to the mean's rounding
    to first order, and that is what catches ``E[x^2] - E[x]^2``-style
    cancellation (errors > 1e-2).
    """
    factor = case.get('tolerance', 1.0)
    half = HALF_EPS.get(case.get('dtype'))
    if half and key.startswith(('y/', 'eval', 'dx/')):
        return half, half
    if key.startswith(('y/', 'eval')):
        rtol, atol = 1e-5, 2e-5
    elif key.startswith(('dx/', 'grad/')):
        rtol, atol = 1e-4, 1e-4
    elif case.get('tight') and is_statistic(key):
        rtol, atol = 2e-6, 0.0
    else:
        rtol, atol = 1e-5, 1e-6
    if not is_statistic(key):
        shifted = 4 * FLOAT32_EPS * abs(case.get('loc', 1.0)) / abs(case.get('scale', 2.0))
        rtol, atol = max(rtol, shifted), max(atol, shifted)
    return rtol * factor, atol * factor


def magnitude(expected, case):
    """What ``atol`` is relative to: the array's largest value, at least the data's scale.

    The floor keeps arrays whose values all lie near zero from demanding more
    than float32 rounding of their neighbours can give. It is the data's own
    spread (``case['scale']``, at most 1), not 1: with data of spread 1e-3
    (the tiny-variance cases), the moving means (~1e-4) and a zero-initialized
    moving variance (~1e-6) would otherwise sit far below a floor of 1, and
    any value near them would pass.
    """
    floor = min(1.0, abs(case.get('scale', 2.0)))
    return max(np.abs(expected).max(), floor) if expected.size else floor


def assert_same_numbers(ours, ref, case, towers):
    """Every array of ``ref`` (outputs, gradients, variables) equals ``ours``'s.

    Tolerances: see :func:`tolerances` and :func:`magnitude`.
    """
    assert sorted(ours) == sorted(ref)
    for key in sorted(ref):
        expected = ref[key].astype(np.float64)
        rtol, atol = tolerances(key, case)
        scale = magnitude(expected, case)
        beta_key = key[:-len('gamma')] + 'beta'
        if key.startswith('grad/') and key.endswith('gamma') and beta_key in ref:
            scale = max(scale, np.abs(ref[beta_key]).max())   # (see tolerances)
        np.testing.assert_allclose(ours[key], expected, rtol=rtol, atol=atol * scale,
                                   err_msg='%s, %d tower(s): %s' % (case['name'], towers, key))
