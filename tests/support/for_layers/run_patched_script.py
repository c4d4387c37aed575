"""Runs ``tf_layers_script.py`` unmodified under ``tf1_syncbn.patch_tf_layers()``.

Records what ``tf.compat.v1.layers`` hands out before the patch, while it is
active (after the script ran) and after ``restore()``, into ``OUT.patch.json``
(with tf-keras, also a second patch once tf-keras is loaded and a module
holds its function):
so a test can tell that the environment is the one it claims (plain
TensorFlow: ``AttributeError ... not available with Keras 3``; tf-keras: its
legacy layers not loaded yet when the patch is applied, tf-keras' ``conv2d``
and ``dense`` afterwards) and that the
patch switched exactly batch normalization and undid itself.

Usage: ``python run_patched_script.py TOWERS OUT.npz`` (the script's own
arguments).
"""

import json
import os
import runpy
import sys
import types

import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
KERAS_LAYERS = 'tf_keras.src.legacy_tf_layers.normalization'


def _lookup(name):
    """``tf.compat.v1.layers.<name>``'s module, or the error it raises."""
    try:
        return getattr(tf.compat.v1.layers, name).__module__
    except AttributeError as e:
        return 'AttributeError: %s' % e


def _patch_with_keras_loaded(tf1_syncbn):
    """A second patch, now that tf-keras is loaded and a module holds its function."""
    user = types.ModuleType('user_module')       # as `from ... import batch_normalization`
    user.bn = tf.compat.v1.layers.batch_normalization
    sys.modules[user.__name__] = user
    try:
        with tf1_syncbn.patch_tf_layers():
            during = [user.bn.__module__, _lookup('batch_normalization')]
        return {'during': during, 'after': [user.bn.__module__,
                                            _lookup('batch_normalization')]}
    finally:
        del sys.modules[user.__name__]


def main():
    # (With TF_USE_LEGACY_KERAS, TensorFlow imports parts of tf-keras itself;
    # its legacy layers only on the first use of tf.compat.v1.layers.)
    record = {'keras_layers_loaded_before': KERAS_LAYERS in sys.modules}
    if not os.environ.get('TF_USE_LEGACY_KERAS'):
        record['before'] = _lookup('batch_normalization')
    import tf1_syncbn  # noqa: PLC0415 - after the check above
    patch = tf1_syncbn.patch_tf_layers(num_dev=int(sys.argv[1]))
    runpy.run_path(os.path.join(HERE, 'tf_layers_script.py'), run_name='__main__')
    record['during'] = {name: _lookup(name) for name in
                        ('batch_normalization', 'BatchNormalization', 'conv2d', 'dense')}
    patch.restore()
    record['after'] = {name: _lookup(name) for name in ('batch_normalization',
                                                        'BatchNormalization')}
    if os.environ.get('TF_USE_LEGACY_KERAS'):
        record['loaded'] = _patch_with_keras_loaded(tf1_syncbn)
    with open(sys.argv[2][:-len('.npz')] + '.patch.json', 'w') as f:
        json.dump(record, f)


if __name__ == '__main__':
    main()
