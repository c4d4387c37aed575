"""tf1_syncbn.keras' layers keep tf-keras' API: training rules, updates, config, weights, errors.

The reference is tf-keras' own class (``tf1_syncbn.keras.KERAS_BATCH_NORMALIZATION``
and ``_V1``, the classes this module subclasses, before any patch) on one
device with the whole batch, in this process; ours runs on 2 synchronized
towers (``tower.TowerContext``). In both TF behaviours. The eager-mode
errors, the ImportError without tf-keras and ``import tf1_syncbn`` not
importing tf-keras are checked in a fresh interpreter (``test_keras_patch``).
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_behavior

from tf1_syncbn import CollectiveBackend
from tf1_syncbn import keras as sync_keras
from tower import TowerContext

tf1 = tf.compat.v1
TOWERS = 2
SHAPE = (6, 3, 2, 4)
THEIRS = {'v2': sync_keras.KERAS_BATCH_NORMALIZATION, 'v1': sync_keras.KERAS_BATCH_NORMALIZATION_V1}
OURS = {'v2': sync_keras.BatchNormalization, 'v1': sync_keras.BatchNormalizationV1}


def _data():
    rng = np.random.RandomState(5)
    return (rng.randn(*SHAPE) * 2 + 1).astype(np.float32)


def _run(make, towers, training, trainable):
    """Builds ``make`` on ``towers`` towers; runs each phase of the learning phase.

    Args:
      training: ``'learning_phase'`` (the call leaves ``training`` out, and
        the session feeds ``K.learning_phase()``), or a Python bool.

    Returns:
      ``{'updates': number of layer.updates, 'train': output (whole batch)
      with learning phase 1 / training as given and the updates run,
      'moving': the moving statistics after that, 'infer': the output with
      learning phase 0 (learning_phase only)}``.
    """
    x = _data()
    rows = np.array_split(np.arange(len(x)), towers)
    graph = tf.Graph()
    with graph.as_default():
        layer = make(momentum=0.8, trainable=trainable)
        placeholders, outputs = [], []
        for i in range(towers):
            placeholder = tf1.placeholder(tf.float32, (None,) + SHAPE[1:])
            kwargs = {} if training == 'learning_phase' else {'training': training}
            if towers == 1:
                outputs.append(layer(placeholder, **kwargs))
            else:
                with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i,
                                                            total=towers):
                    outputs.append(layer(placeholder, **kwargs))
            placeholders.append(placeholder)
        updates = layer.updates
        assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)    # tf-keras' rule
        phase = tf_keras.backend.learning_phase()
        with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': towers})) as sess:
            sess.run(tf1.global_variables_initializer())
            feed = {p: x[r] for p, r in zip(placeholders, rows)}
            result = {'updates': len(updates) > 0}
            if training == 'learning_phase':
                feed[phase] = True
            result['train'] = np.concatenate(sess.run(outputs + updates, feed)[:towers])
            result['moving'] = sess.run([layer.moving_mean, layer.moving_variance])
            if training == 'learning_phase':
                feed[phase] = False
                result['infer'] = np.concatenate(sess.run(outputs, feed))
    return result


@pytest.mark.parametrize('version,training,trainable', [
    ('v2', 'learning_phase', True), ('v1', 'learning_phase', True),
    ('v2', True, False),         # frozen in fine-tuning: inference mode, no updates
    ('v1', True, False),         # the v1 layer: batch statistics, updates not reported
])
def test_training_rules_are_tf_keras(version, training, trainable):
    theirs = _run(THEIRS[version], 1, training, trainable)
    ours = _run(lambda **kw: OURS[version](sync_statistics=CollectiveBackend(timeout=60), **kw),
                TOWERS, training, trainable)
    assert ours['updates'] == theirs['updates']
    for key in ('train', 'infer'):
        if key in theirs:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-5, err_msg=key)
    for ours_value, theirs_value in zip(ours['moving'], theirs['moving']):
        np.testing.assert_allclose(ours_value, theirs_value, rtol=1e-5)
    if not trainable and version == 'v2':       # inference mode: the moving statistics
        assert not np.allclose(theirs['train'].mean((0, 1, 2)), 0, atol=0.1)
    if training == 'learning_phase':            # the phases differ: the test tells them apart
        assert not np.allclose(theirs['train'], theirs['infer'], atol=0.1)


def test_updates_are_the_main_towers_and_triggers():
    """Tower 0 holds the update ops, tower 1 a trigger of them; ``UPDATE_OPS`` stays empty.

    Each tower's ``get_updates_for(its input)`` holds what runs the updates
    (tower 0's also the trigger, which waits for the update ops).
    """
    with tf.Graph().as_default():
        layer = sync_keras.BatchNormalization(sync_statistics=CollectiveBackend(timeout=60))
        inputs = [tf1.placeholder(tf.float32, (None, 4)) for _ in range(TOWERS)]
        for i, x in enumerate(inputs):
            with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=TOWERS):
                layer(x, training=True)
        types = [u.type for u in layer.updates]
        assert types == ['AssignSubVariableOp', 'AssignSubVariableOp', 'NoOp'], types
        assert layer.get_updates_for(inputs[0]) == layer.updates
        assert layer.get_updates_for(inputs[1]) == layer.updates[2:]
        assert layer.get_updates_for(None) == []
        assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        assert not tf1.get_collection('tf1_syncbn_keras_updates')


@pytest.mark.parametrize('kwargs', [
    {}, {'axis': 1, 'momentum': 0.9, 'epsilon': 1e-5, 'center': False},
    {'renorm': True, 'renorm_clipping': {'rmax': 2.0}, 'renorm_momentum': 0.9},
    {'virtual_batch_size': 2, 'gamma_regularizer': 'l2', 'beta_constraint': 'non_neg'},
])
def test_config_is_tf_keras_and_round_trips(kwargs):
    with tf.Graph().as_default():
        ours = sync_keras.BatchNormalization(name='bn', **kwargs)
        theirs = THEIRS['v2'](name='bn', **kwargs)
        assert ours.get_config() == theirs.get_config()
        # tf-keras makes its layer from our config, and we make ours from theirs.
        assert THEIRS['v2'].from_config(ours.get_config()).get_config() == theirs.get_config()
        assert sync_keras.BatchNormalization.from_config(
            theirs.get_config()).get_config() == ours.get_config()


def test_config_keeps_the_sync_arguments_that_are_not_defaults():
    with tf.Graph().as_default():
        layer = sync_keras.BatchNormalization(name='bn', num_dev=4, sync_statistics='collective')
        config = layer.get_config()
        assert config['num_dev'] == 4 and config['sync_statistics'] == 'collective'
        again = sync_keras.BatchNormalization.from_config(config)
        assert (again.num_dev, again.sync_statistics) == (4, 'collective')
        assert sync_keras.BatchNormalization.from_config(
            sync_keras.BatchNormalization(sync_statistics=None).get_config()
        ).sync_statistics is None
        with pytest.warns(UserWarning, match='cannot be serialized'):
            config = sync_keras.BatchNormalization(
                sync_statistics=CollectiveBackend()).get_config()
        assert 'sync_statistics' not in config


def _model(make):
    inputs = tf_keras.Input((6, 6, 3))
    x = tf_keras.layers.Conv2D(4, 3, name='conv')(inputs)
    x = make(name='bn')(x)
    x = tf_keras.layers.Dense(5, name='fc')(tf_keras.layers.GlobalAveragePooling2D()(x))
    return tf_keras.Model(inputs, make(renorm=True, name='bn_renorm')(x))


@pytest.mark.parametrize('form', ['tf', 'h5', 'saver'])
@pytest.mark.parametrize('direction', ['tf-keras to ours', 'ours to tf-keras'])
def test_weights_and_checkpoints_load_both_ways(tmp_path, form, direction):
    """Weight names, order and values: a checkpoint of one model loads into the other."""
    path = str(tmp_path / ('weights.h5' if form == 'h5' else 'weights'))
    makes = [THEIRS['v2'], sync_keras.BatchNormalization]
    if direction != 'tf-keras to ours':
        makes.reverse()
    records = []
    for step, make in enumerate(makes):
        graph = tf.Graph()
        with graph.as_default():
            model = _model(make)
            saver = tf1.train.Saver()
            with tf1.Session(graph=graph) as sess:
                sess.run(tf1.global_variables_initializer())
                if step == 0:
                    rng = np.random.RandomState(0)
                    model.set_weights([rng.uniform(0.5, 1.5, w.shape).astype(np.float32)
                                       for w in model.get_weights()])
                    saver.save(sess, path) if form == 'saver' else model.save_weights(path)
                elif form == 'saver':
                    saver.restore(sess, path)
                else:
                    model.load_weights(path)
                records.append(([w.name for w in model.weights], model.get_weights()))
    (names, saved), (loaded_names, loaded) = records
    assert names == loaded_names and len(names) == 15
    for name, a, b in zip(names, saved, loaded):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize('kwargs,match', [
    ({'axis': 0}, r'BatchNormalization\(bn\): axis=0 includes the batch axis 0'),
    ({'axis': [0, 3], 'fused': False}, r'axis=\[0, 3\] includes the batch axis 0'),
])
def test_the_batch_axis_is_an_error(kwargs, match):
    """tf-keras normalizes each example alone there, with batch-sized variables: refused."""
    with tf.Graph().as_default(), pytest.raises(ValueError, match=match):
        sync_keras.BatchNormalization(name='bn', **kwargs)(
            tf1.placeholder(tf.float32, (4, 3, 5, 2)), training=True)


def test_a_mask_the_layer_cannot_weight_is_an_error():
    with tf.Graph().as_default():
        layer = sync_keras.BatchNormalization(name='bn')
        with pytest.raises(ValueError, match=r'BatchNormalization\(bn\): a mask of shape'):
            layer(tf1.placeholder(tf.float32, (4, 3, 2)), training=True,
                  mask=tf1.placeholder(tf.bool, (4, 3)))
        fused = sync_keras.BatchNormalization(name='fused')
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            fused(tf1.placeholder(tf.float32, (4, 3, 2, 2)), training=True,
                  mask=tf1.placeholder(tf.bool, (4,)))
        assert any('Masking is not supported with `fused=True`' in str(w.message)
                   for w in caught)


def test_num_dev_outside_any_tower_is_an_error_but_not_for_the_models_own_graph():
    """A model's construction call (its keras.Input) is one device; a plain call is not a tower."""
    with tf.Graph().as_default():
        with sync_keras.patch_keras(num_dev=2):
            model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.BatchNormalization(
                name='bn')])                 # built on its keras.Input: fine
            # (also where Keras casts the input to a mixed-precision compute dtype)
            tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.BatchNormalization(
                dtype='mixed_float16')])
        with pytest.raises(ValueError, match=r'BatchNormalization\(bn\): num_dev=2 but the '
                                             r'layer is built outside any tower'):
            model(tf1.placeholder(tf.float32, (None, 4)), training=True)


def test_model_build_before_the_tower_loop_is_one_device_and_towers_synchronize():
    """``model.build(input_shape)`` (Keras' own placeholders, no Keras history) before a
    tower_%d loop: one device (it was the 'outside any tower' error); the towers synchronize."""
    x = _data().reshape(6, -1)[:, :4]
    with tf.Graph().as_default() as graph:
        with sync_keras.patch_keras(num_dev=TOWERS):
            model = tf_keras.Sequential([tf_keras.layers.BatchNormalization(name='bn',
                                                                            momentum=0.0)])
            model.build((None, 4))
        placeholders = [tf1.placeholder(tf.float32, (None, 4)) for _ in range(TOWERS)]
        outputs = []
        for i in range(TOWERS):
            with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
                outputs.append(model(placeholders[i], training=True))
        assert sorted({op.type for op in graph.get_operations()
                       if op.type.startswith('Collective')}) == ['CollectiveReduce']
        with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': TOWERS})) as sess:
            sess.run(tf1.global_variables_initializer())
            ours = np.concatenate(sess.run(outputs, {placeholders[0]: x[:2],
                                                     placeholders[1]: x[2:]}))
    want = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-3)          # the global batch's statistics
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)


def test_fit_on_one_device_is_tf_keras():
    """Keras' own v1 training loop (``compile`` / ``fit``) with the layer: tf-keras' numbers."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 4).astype(np.float32), rng.randn(16, 2).astype(np.float32)
    results = []
    for make in (THEIRS['v2'], sync_keras.BatchNormalization):
        with tf.Graph().as_default():
            inputs = tf_keras.Input((4,))
            outputs = tf_keras.layers.Dense(2, kernel_initializer='ones')(
                make(momentum=0.5, name='bn')(inputs))
            model = tf_keras.Model(inputs, outputs)
            model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1), loss='mse')
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
            results.append((history.history['loss'], model.get_weights()))
    (their_losses, theirs), (our_losses, ours) = results
    np.testing.assert_allclose(our_losses, their_losses, rtol=1e-5)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('version', ['v2', 'v1'])
def test_set_learning_phase_is_read(version):
    """``K.set_learning_phase(1)`` (a Python int) trains, as in tf-keras."""
    outputs = []
    for make in (THEIRS[version], OURS[version]):
        with tf.Graph().as_default():
            tf_keras.backend.set_learning_phase(1)
            layer = make(momentum=0.5)
            y = layer(tf.constant(_data()))
            assert len(layer.updates) == 2
            with tf1.Session() as sess:
                sess.run(tf1.global_variables_initializer())
                outputs.append(sess.run(y))
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    assert abs(outputs[0].mean()) < 1e-3           # batch statistics: trained


def test_a_model_built_on_a_towers_tensor_is_that_towers():
    """``keras.Input(tensor=x)`` in the first tower (tensorpack's KerasModelCaller does so)."""
    x = _data()
    rows = np.array_split(np.arange(len(x)), TOWERS)
    with tf.Graph().as_default():
        placeholders = [tf1.placeholder(tf.float32, (None,) + SHAPE[1:]) for _ in range(TOWERS)]
        outputs = []
        for i in range(TOWERS):
            with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=TOWERS):
                if i == 0:
                    inputs = tf_keras.Input(tensor=placeholders[0])
                    bn = sync_keras.BatchNormalization(
                        momentum=0.8, sync_statistics=CollectiveBackend(timeout=60))
                    model = tf_keras.Model(inputs, bn(inputs, training=True))
                    outputs.append(model.outputs[0])
                else:
                    outputs.append(model(placeholders[i], training=True))
        with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': TOWERS})) as sess:
            sess.run(tf1.global_variables_initializer())
            ours = np.concatenate(sess.run(outputs + model.updates,
                                           {p: x[r] for p, r in zip(placeholders, rows)})[:TOWERS])
            moving = sess.run(bn.moving_mean)
    np.testing.assert_allclose(ours, _run(THEIRS['v2'], 1, True, True)['train'], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(moving, 0.2 * x.mean((0, 1, 2)), rtol=1e-5)


def _last_towers_updates(make_model, tower_scope):
    """Two towers; runs every tower's forward and only the LAST tower's
    ``model.get_updates_for(its input)`` (the classic multi-GPU script's choice).

    Returns:
      ``(updates per tower, moving mean, moving variance)``, the statistics read
      in a run of their own (TF1 behaviour: a variable read beside its update races).
    """
    x = _data()
    rows = np.array_split(np.arange(len(x)), TOWERS)
    with tf.Graph().as_default():
        model = make_model()
        placeholders = [tf1.placeholder(tf.float32, (None,) + SHAPE[1:]) for _ in range(TOWERS)]
        outputs = []
        for i, placeholder in enumerate(placeholders):
            with tf.device('/cpu:%d' % i), tower_scope(i):
                outputs.append(model(placeholder, training=True))
        per_tower = [model.get_updates_for(p) for p in placeholders]
        layer = model.layers[0]
        with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': TOWERS})) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(outputs + per_tower[-1], {p: x[r] for p, r in zip(placeholders, rows)})
            mean, variance = sess.run([layer.moving_mean, layer.moving_variance])
    return [len(u) for u in per_tower], mean, variance


@pytest.mark.parametrize('form', tf_behavior.pick(['patch', 'class'], ['patch']))
def test_the_last_towers_updates_move_the_statistics_once(form):
    """Each tower's ``model.get_updates_for(its input)`` holds its updates or trigger.

    Before, a non-main tower's trigger had only control inputs from the main
    tower's assignments, so tf-keras filed it as unconditional: ``[2, 0]``
    updates per tower, and a script that keeps the last tower's never moved
    ``moving_mean``. Reference: numpy float64 on the concatenated batch
    (tf-keras' fused path: the Bessel-corrected variance, ``1 - momentum``).
    """
    if form == 'patch':
        def make_model():
            with sync_keras.patch_keras(num_dev=TOWERS):
                return tf_keras.Sequential([tf_keras.layers.BatchNormalization(momentum=0.8)])
        counts, mean, variance = _last_towers_updates(
            make_model, lambda i: tf.name_scope('tower_%d' % i))
    else:
        counts, mean, variance = _last_towers_updates(
            lambda: tf_keras.Sequential([sync_keras.BatchNormalization(
                momentum=0.8, sync_statistics=CollectiveBackend(timeout=60))]),
            lambda i: TowerContext('tower%d' % i, index=i, total=TOWERS))
    assert all(counts), counts
    flat = _data().astype(np.float64).reshape(-1, SHAPE[-1])
    np.testing.assert_allclose(mean, 0.2 * flat.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance, 0.8 + 0.2 * flat.var(0, ddof=1), rtol=1e-5)
