"""Your own ops on a layer's variables: a ``custom_getter`` on every front-end, at full speed.

The seed question (StackOverflow, "Batch normalization in tensorflow:
variables and performance") wants fake quantization, switched on by a bool
``tf.cond`` for a fine-tuning phase, on all four variables of a batch norm:
``gamma``, ``beta``, the moving mean and the moving variance. Its
hand-written layer ran 2x slower than tf.layers'. TF1's idiom is a
``custom_getter`` on the enclosing variable scope; tf-slim's ``batch_norm``,
tf.layers' and tensorpack's ``BatchNorm`` fail on it in training (their
moving-average updates call ``assign_sub`` on what the getter returned).

On ``sync_batch_norm``, ``tf1_syncbn.layers.batch_normalization`` and
``tf1_syncbn.BatchNorm``, on one tower and on 2 uneven towers
(``tower.call_for_each_tower`` on virtual CPUs), with ``training`` True,
False and a bool tensor, over three SGD steps (quantization off, then on):

* outputs, input and parameter gradients and every variable equal the seed
  question's own layer on one device with the whole batch
  (``tf.nn.fused_batch_norm`` with the transformed ``gamma``, ``beta`` and
  moving statistics; the moving averages assign the variables under the
  getter, from the batch statistics, as without a getter);
* where the replaced layer supports the getter (all four variables in
  inference, ``gamma`` and ``beta`` in training), they equal the replaced
  layer itself with the same getter (in the legacy-Keras subprocess of
  ``layers_reference.py``);
* the layer builds the same ops with and without the getter (per tower, in
  the graph and in its ``tf.cond`` branches; only the reads of the variables
  move into the getter), the compiled kernels (``SyncBnMoments``, ...) on
  the synchronized towers and the fused kernel on one;
* a getter that returns a value computed from no variable is the layer's
  ``TypeError``.

Controls: a layer that ignores the getter fails the comparison, in every
``training`` mode.
"""

import collections
import functools
import json

import numpy as np
import pytest
import tensorflow as tf

import getter_case
import tf_behavior
from getter_case import LEGACY_CASES, MODES, UNSUPPORTED_CASES, legacy_key, seed_layer, train
from legacy_reference import run_reference
import tf1_syncbn
from tf1_syncbn import BatchNorm, CollectiveBackend, kernels, sync_batch_norm

tf1 = tf.compat.v1
FRONT_ENDS = ('slim', 'layers', 'tensorpack')
TOWERS = {1: [8], 2: [3, 5]}
KERNEL_OPS = {'SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput'}


def ours(front_end, towers):
    """``apply`` for ``getter_case.train``: the library's front-end, as users call it."""
    sync = CollectiveBackend(timeout=60) if towers > 1 else None
    momentum, epsilon = getter_case.MOMENTUM, getter_case.EPSILON

    def apply(x, training, _):
        if front_end == 'slim':
            return sync_batch_norm(x, decay=momentum, epsilon=epsilon, scale=True,
                                   is_training=training, scope='bn', sync_statistics=sync)
        if front_end == 'layers':
            return tf1_syncbn.layers.batch_normalization(
                x, momentum=momentum, epsilon=epsilon, training=training, name='bn',
                sync_statistics=sync)
        return BatchNorm('bn', x, momentum=momentum, epsilon=epsilon, training=training,
                         sync_statistics=sync)
    return apply


@functools.lru_cache(maxsize=None)
def _run(front_end, mode, towers, which='all', getter=True, steps=getter_case.STEPS):
    return train(ours(front_end, towers), mode, TOWERS[towers], front_end, which, getter,
                 steps)


@functools.lru_cache(maxsize=None)
def _seed(front_end, mode):
    return train(seed_layer(front_end), mode, [getter_case.SHAPE[0]], front_end,
                 getter=False)[0]


def assert_same(ours_arrays, ref, what):
    """Every array of ``ref`` equals ``ours_arrays``'s (float32 tolerances, as the parity tests)."""
    assert sorted(ours_arrays) == sorted(ref), what
    for key in sorted(ref):
        expected = ref[key].astype(np.float64)
        rtol, atol = (1e-4, 1e-4) if key.startswith(('dx/', 'grad/')) else (1e-5, 2e-6)
        if key.startswith(('y/', 'eval')):
            atol = 2e-5
        scale = max(np.abs(expected).max(), 1.0)
        np.testing.assert_allclose(ours_arrays[key], expected, rtol=rtol, atol=atol * scale,
                                   err_msg='%s: %s' % (what, key))


@pytest.fixture(scope='module', autouse=True)
def _compiled_kernels():
    assert kernels.load() is not None, kernels.status()


@pytest.mark.parametrize('towers', sorted(TOWERS))
@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('front_end', FRONT_ENDS)
def test_outputs_gradients_and_updates_are_the_seed_layers(front_end, mode, towers):
    arrays, record, _ = _run(front_end, mode, towers)
    assert record.getter_calls == 4 * (towers + 1)     # every tower, and the eval call
    assert_same(arrays, _seed(front_end, mode), '%s, training %s, %d tower(s)'
                % (front_end, mode, towers))
    # The variables under the getter are the layer's, named as without it.
    names = getter_case.NAMES[front_end]
    assert {k.split('/', 2)[2] for k in arrays if k.startswith('var/0/')} == \
        {'net/bn/' + n for n in names}


@pytest.mark.parametrize('mode', MODES)
def test_a_layer_that_ignores_the_getter_fails_the_comparison(mode):
    """The control: the plain layer (no getter) against the seed layer with the getter."""
    plain = _run('layers', mode, 2, getter=None)[0]
    with pytest.raises(AssertionError, match=r'layers: (y|dx|grad|var|eval)'):
        assert_same(plain, _seed('layers', mode), 'layers')


#: The replaced layers under the getter (getter_case.run_legacy_cases), alone in
#: a legacy-Keras subprocess: what layers_reference.py also runs among the
#: layers modules' references, without those (a module of its own need not wait
#: for them where no layers module shares its test process).
LEGACY_SCRIPT = '''
import json, sys
import numpy as np
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
import getter_case

arrays, errors = getter_case.run_legacy_cases()
np.savez(sys.argv[1] + '.npz', **{key + '|' + name: value for key, values in arrays.items()
                                  for name, value in values.items()})
with open(sys.argv[1] + '.json', 'w') as f:
    json.dump(errors, f)
print('RESULT ' + sys.argv[1])
'''


@pytest.fixture(scope='module')
def legacy(tmp_path_factory):
    """The replaced layers' ``(arrays by case, errors by case)`` (``run_legacy_cases``)."""
    tmp = tmp_path_factory.mktemp('getter_legacy_reference')
    run_reference(LEGACY_SCRIPT, tmp, args=[str(tmp / 'getter')], timeout=600)
    arrays = {}
    loaded = np.load(tmp / 'getter.npz')
    for name in loaded.files:
        key, array = name.split('|', 1)
        arrays.setdefault(key, {})[array] = loaded[name]
    return arrays, json.loads((tmp / 'getter.json').read_text())


@pytest.mark.parametrize('front_end,mode,which', LEGACY_CASES,
                         ids=[legacy_key(*case) for case in LEGACY_CASES])
def test_towers_are_the_replaced_layer_with_the_same_getter(legacy, front_end, mode, which):
    """tf-slim, tf.layers and tensorpack themselves, where they support the getter.

    All four variables in inference; ``gamma`` and ``beta`` in training
    (there, their updates fail on a transformed moving statistic: see
    :func:`test_the_replaced_layers_fail_where_this_one_does_not`).
    """
    key = legacy_key(front_end, mode, which)
    arrays, errors = legacy
    assert key not in errors, errors[key]
    ref = arrays[key]
    assert_same(_run(front_end, mode, 2, which)[0], ref, legacy_key(front_end, mode, which))


def test_the_replaced_layers_fail_where_this_one_does_not(legacy):
    """A transformed moving statistic in training: ``assign_sub`` on a tensor, in each of them."""
    errors = legacy[1]
    assert sorted(errors) == sorted(legacy_key(*case) for case in UNSUPPORTED_CASES)
    for key, error in errors.items():
        assert "object has no attribute 'assign_sub'" in error, (key, error)


def _without_reads(counts):
    return collections.Counter({k: v for k, v in counts.items() if 'ReadVariableOp' not in k})


@pytest.mark.parametrize('towers', sorted(TOWERS))
@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('front_end', FRONT_ENDS)
def test_the_layer_builds_the_same_ops_with_the_getter(front_end, mode, towers):
    """Per tower, the same ops (graph and cond branches) with and without the getter.

    Only the layer's reads of its variables (``ReadVariableOp``) move into the
    getter; the getter's own ops are counted apart, as the getter builds them
    (one ``tf.cond`` per variable and tower). The kernels are the same: the
    compiled ones on synchronized CPU towers, the fused one on one tower.
    """
    _, record, graph = _run(front_end, mode, towers)
    _, plain, plain_graph = _run(front_end, mode, towers, getter=None, steps=0)
    assert len(record.layer_ops) == len(plain.layer_ops) == towers
    for tower, (with_getter, without) in enumerate(zip(record.layer_ops, plain.layer_ops)):
        assert _without_reads(with_getter) == _without_reads(without), tower
        assert with_getter['ReadVariableOp'] <= without['ReadVariableOp'], tower
    one_cond = _ops_of_one_transform()
    assert len(record.getter_ops) == record.getter_calls * one_cond
    assert plain.getter_calls == 0

    def batch_norm_kernels(g):
        return {t for t in getter_case.op_types(g) if t.startswith(('SyncBn', 'FusedBatchNorm'))}
    assert batch_norm_kernels(graph) == batch_norm_kernels(plain_graph)
    if mode != 'false':
        expected = KERNEL_OPS if towers > 1 else {'FusedBatchNormV3'}
        assert expected <= batch_norm_kernels(graph), batch_norm_kernels(graph)


@functools.lru_cache(maxsize=None)
def _ops_of_one_transform():
    with tf.Graph().as_default() as graph:
        quant = tf1.placeholder(tf.bool, [])
        variable = tf1.get_variable('v', [3])
        start = len(graph.get_operations())
        getter_case.transform(variable, quant)
        return len(graph.get_operations()) - start


@pytest.mark.parametrize('mode', ['true', 'tensor'])
@pytest.mark.parametrize('front_end', FRONT_ENDS)
def test_a_getter_that_returns_no_variable_is_a_type_error(front_end, mode):
    """A moving statistic replaced by a constant: its moving average has nothing to assign."""
    def getter(getter, name, *args, **kwargs):
        variable = getter(name, *args, **kwargs)
        if name.endswith(getter_case.NAMES[front_end][2]):
            return tf.zeros(variable.shape)
        return variable

    with tf.Graph().as_default():
        training = True if mode == 'true' else tf1.placeholder(tf.bool, [])
        x = tf1.placeholder(tf.float32, [None] + getter_case.SHAPE[1:])
        with tf1.variable_scope('net', custom_getter=getter):
            with pytest.raises(TypeError, match='computed from no variable of this graph, so '
                                                'its moving average cannot be updated'):
                ours(front_end, 1)(x, training, None)


@pytest.mark.parametrize('front_end', ['slim', 'tensorpack'])
def test_model_variables_are_the_variables_under_the_getter(front_end):
    """``MODEL_VARIABLES`` holds variables, not the getter's tensors: a Saver over them works.

    (tf.layers adds nothing to ``MODEL_VARIABLES``, nor does its front-end.)
    """
    def getter(getter, name, *args, **kwargs):
        return tf.identity(getter(name, *args, **kwargs))

    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None] + getter_case.SHAPE[1:])
        with tf1.variable_scope('net', custom_getter=getter):
            ours(front_end, 1)(x, True, None)
        model_variables = tf1.model_variables()
        names = sorted(v.op.name for v in model_variables)
        assert any('moving_mean' in n or 'mean/EMA' in n for n in names), names
        assert all(isinstance(v, tf.Variable) for v in model_variables), model_variables
        tf1.train.Saver(model_variables)


def _scaled_statistics_step(front_end, form, training):
    """One training step under a getter returning ``tf.multiply(scale, variable)`` for the
    moving statistics, ``scale`` a per-channel variable of the getter's own (``[2, 2, 2]``).

    Args:
      form: ``'outside'``: ``scale`` is created before, outside the getter;
        ``'through_getter'``: with the getter it received
        (``getter(name + '_scale', ...)``), so the getter creates two variables.

    Returns:
      ``{variable name: value}`` after the step (read in a run of their own).
    """
    x = (np.random.RandomState(3).randn(*getter_case.SHAPE) + 0.5).astype(np.float32)
    channels = getter_case.SHAPE[-1]
    statistics = getter_case.NAMES[front_end][2:]
    with tf.Graph().as_default():
        scales = {}
        if form == 'outside':
            with tf1.variable_scope('scales'):
                for stat in statistics:
                    scales[stat] = tf1.get_variable(stat.replace('/', '_'), initializer=tf.fill(
                        [channels], 2.0), trainable=False)

        def getter(getter, name, *args, **kwargs):
            variable = getter(name, *args, **kwargs)
            for stat in statistics:
                if name.endswith('/' + stat):
                    scale = scales.get(stat)
                    if scale is None:
                        scale = getter(name + '_scale', shape=[channels], dtype=tf.float32,
                                       initializer=tf1.constant_initializer(2.0),
                                       trainable=False)
                    return tf.multiply(scale, variable)
            return variable

        placeholder = tf1.placeholder(tf.float32, [None] + getter_case.SHAPE[1:])
        feed = {placeholder: x}
        if training == 'tensor':
            training = tf1.placeholder(tf.bool, [])
            feed[training] = True
        else:
            training = True
        with tf1.variable_scope('net', custom_getter=getter):
            y = ours(front_end, 1)(placeholder, training, None)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run([y] + tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), feed)
            variables = tf1.global_variables()
            return {v.op.name: value for v, value in zip(variables, sess.run(variables))}, x


@pytest.mark.parametrize('front_end,form,training', tf_behavior.pick(
    [(fe, form, 'true') for fe in FRONT_ENDS for form in ('outside', 'through_getter')] +
    [('layers', 'through_getter', 'tensor')],
    [('slim', 'outside', 'true'), ('layers', 'through_getter', 'tensor')]))
def test_the_update_assigns_the_variable_the_getter_received(front_end, form, training):
    """Before, the update assigned the first variable met walking back from the getter's
    value: ``scale`` (corrupted), and the moving statistics stayed at their initial values.

    Reference: numpy float64 on the batch (the fused kernel's Bessel-corrected
    variance); every ``scale`` keeps its value.
    """
    values, x = _scaled_statistics_step(front_end, form, training)
    mean_name, variance_name = getter_case.NAMES[front_end][2:]
    flat = x.astype(np.float64).reshape(-1, x.shape[-1])
    momentum = getter_case.MOMENTUM
    np.testing.assert_allclose(values['net/bn/' + mean_name], (1 - momentum) * flat.mean(0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values['net/bn/' + variance_name],
                               momentum + (1 - momentum) * flat.var(0, ddof=1), rtol=1e-5)
    scales = {k: v for k, v in values.items() if k.startswith('scales/') or k.endswith('_scale')}
    assert len(scales) == 2, sorted(values)
    for name, value in scales.items():
        np.testing.assert_array_equal(value, 2.0, err_msg=name)
