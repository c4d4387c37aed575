"""Layer-level cases of tf-keras' ``BatchNormalization``, for both sides of the parity tests.

``MODEL`` defines ``keras_apply(make, case, x, weights, training, tower,
towers)``: the layer made by ``make`` (tf-keras' own class in the reference,
``tf1_syncbn.keras``' in the test) called as a Keras model calls it in each
tower, once per graph created (its weights outside the towers, as a model
built before its towers has them) and called again in every tower; each
call's new ``layer.updates`` go to ``UPDATE_OPS``, where
``parity_harness.train_case`` runs them with the train op. Both sides
``exec`` it. A case is ``parity_harness``' dict with:

* ``kwargs``: the layer's constructor arguments (JSON);
* ``class``: ``'v2'`` (``tf_keras.layers.BatchNormalization``, default) or
  ``'v1'`` (``tf.compat.v1.keras.layers.BatchNormalization``);
* ``mixed``: in TF2 behaviour the layer gets ``dtype='mixed_float16'`` (or
  ``'mixed_bfloat16'``, after ``case['dtype']``); in TF1 behaviour, where
  tf-keras has no dtype policies, the layer takes the 16-bit input's type;
* ``mask``: the layer is called with ``mask=weights`` (a per-example weight);
* ``adjustment``: a fixed ``adjustment`` function;
* ``sizes``: the towers' batch sizes (default ``parity_harness.DEFAULT_SIZES``).
"""

import tf_behavior

MODEL = '''
import contextlib
import tf_keras

_LAYERS = {}


def _adjustment(shape):
    return tf.fill(shape[-1:], 1.25), tf.fill(shape[-1:], -0.5)


def keras_apply(make, case, x, weights, training, tower, towers):
    """The case's layer on ``x``, called as a Keras model calls it in a tower."""
    del towers
    graph = tf1.get_default_graph()
    first = graph not in _LAYERS
    if first:
        kwargs = dict(case.get('kwargs', {}))
        if case.get('mixed') and tf.__internal__.tf2.enabled():
            kwargs['dtype'] = 'mixed_' + case['dtype']
        if case.get('adjustment'):
            kwargs['adjustment'] = _adjustment
        _LAYERS.clear()
        _LAYERS[graph] = make(**kwargs)
    layer = _LAYERS[graph]
    call = {'training': training}
    if case.get('mask') and tower is not None:
        call['mask'] = weights
    seen = {id(u) for u in layer.updates}
    # The first call builds the weights: at the root name scope, as a model
    # built before its towers names them (conv1_bn/gamma, not tower0/...).
    with graph.name_scope(None) if first else contextlib.nullcontext():
        y = layer(x, **call)
    for update in layer.updates:
        if id(update) not in seen:
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
    return y
'''

REFERENCE_APPLY = '''
def reference_apply(case, *args):
    make = {'v2': tf_keras.layers.BatchNormalization,
            'v1': tf1.keras.layers.BatchNormalization}[case.get('class', 'v2')]
    assert make.__module__.startswith('tf_keras.'), make
    return keras_apply(make, case, *args)
'''


def _case(name, shape, **options):
    kwargs = dict(momentum=0.8, epsilon=1e-3)
    kwargs.update(options.pop('kwargs', {}))
    return dict(name=name, shape=shape, kwargs=kwargs, **options)


RENORM = {'renorm': True, 'renorm_momentum': 0.7,
          'renorm_clipping': {'rmax': 1.5, 'rmin': 0.8, 'dmax': 0.3}}

CASES = [
    _case('rank4', [8, 3, 2, 3]),
    _case('rank4-axis1', [8, 3, 2, 3], kwargs={'axis': 1}),
    _case('rank2', [8, 3]),
    _case('rank3-axis1', [8, 3, 4], kwargs={'axis': 1}),
    _case('rank5-axis-1', [8, 2, 2, 2, 3], kwargs={'axis': -1}),
    _case('fused=False-rank4', [8, 3, 2, 3], kwargs={'fused': False}),
    _case('center=scale=False-rank4', [8, 3, 2, 3], kwargs={'center': False, 'scale': False}),
    _case('renorm-rank4', [8, 3, 2, 3], kwargs=RENORM),
    _case('training_tensor-rank4', [8, 3, 2, 3], training_tensor=True),
    _case('training_tensor-rank2', [8, 3], training_tensor=True),
    _case('float16-rank4', [8, 3, 2, 3], dtype='float16', mixed=True),
    _case('float16-rank2', [8, 3], dtype='float16', mixed=True),
    _case('bfloat16-rank4-axis1', [8, 3, 2, 3], dtype='bfloat16', mixed=True,
          kwargs={'axis': 1}),
    _case('mask-rank2', [8, 3], mask=True),
    _case('adjustment-rank4', [8, 3, 2, 3], adjustment=True),
    _case('synchronized=True-rank4', [8, 3, 2, 3], kwargs={'synchronized': True}),
    _case('mean1e4-rank4', [8, 3, 2, 3], loc=1e4, scale=1.0, learning_rate=0.0),
    _case('rank4-axis2', [8, 3, 2, 3], kwargs={'axis': 2}),
    _case('rank3-axes[1,2]', [8, 3, 2], kwargs={'axis': [1, 2]}),
    _case('rank4-axes[1,3]-training_tensor', [8, 3, 2, 3], kwargs={'axis': [1, 3]},
          training_tensor=True),
    _case('virtual_batch_size-rank4', [8, 3, 2, 3], kwargs={'virtual_batch_size': 4},
          sizes=[4, 4], interleave=True),
    _case('v1-rank4-axis1', [8, 3, 2, 3], kwargs={'axis': 1}, **{'class': 'v1'}),
    _case('v1-training_tensor-rank2', [8, 3], training_tensor=True, **{'class': 'v1'}),
]
NAMES = [c['name'] for c in CASES]
#: The cases of the TF1-behaviour pass (``tf_behavior.pick``): the paths TF1
#: behaviour changes: v1 ``tf.cond`` (a bool-tensor ``training``), its dtype
#: rules (16-bit inputs without policies), tf-keras' v1 class and its ghost
#: batches, one case of each layout.
V1_NAMES = ('rank4', 'rank2', 'training_tensor-rank4', 'training_tensor-rank2', 'float16-rank4',
            'renorm-rank4', 'rank4-axes[1,3]-training_tensor', 'virtual_batch_size-rank4',
            'v1-rank4-axis1', 'v1-training_tensor-rank2')
#: The cases this process runs (every one in the TF2-behaviour pass).
RUN_CASES = tf_behavior.pick(CASES, [CASES[NAMES.index(n)] for n in V1_NAMES])
#: Through which a child run (``without_onednn``) finds its parent's reference run.
REFERENCE_DIR_VARIABLE = 'TF1_SYNCBN_TEST_KERAS_REFERENCE'
_RUNS = {}


def reference_dir(tmp_path_factory):
    """tf-keras' own layer on every case of :data:`RUN_CASES` on one device, once per session.

    In a subprocess with legacy Keras (``reference_cases``); a child run
    reads its parent's directory from :data:`REFERENCE_DIR_VARIABLE`.
    """
    if 'dir' not in _RUNS:
        import reference_cases  # noqa: PLC0415 - the test side only
        _RUNS['dir'] = reference_cases.reference_dir(
            tmp_path_factory, 'keras_reference', RUN_CASES, MODEL, REFERENCE_APPLY,
            REFERENCE_DIR_VARIABLE)
    return _RUNS['dir']
