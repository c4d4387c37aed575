"""tf.layers' own batch normalization as the reference, run once per test session.

One subprocess with tf-keras and ``TF_USE_LEGACY_KERAS=1``
(``legacy_reference.run_reference``), where ``tf.compat.v1.layers`` is
tf-keras' legacy layer, computes everything the ``test_layers*`` modules
compare with: every parity case of ``layers_cases`` on one device, the
scenarios' records, the tf.distribute model of ``strategy_case`` on one
device (and a checkpoint written by tf.layers code, with the training that
continues from it), and ``tf_layers_script.py`` on one tower. It also runs,
for ``test_custom_getter.py``, tf-slim's, tf.layers' and tensorpack's own
batch norm under the custom getter of ``getter_case`` (one run for every
reference that needs legacy Keras). It never imports ``tf1_syncbn``.
:func:`reference` caches the results for the process, so that several test
modules share one run; a child pytest (``without_onednn``) finds its
parent's run through :data:`REFERENCE_DIR_VARIABLE`.
"""

import json
import os
import pathlib

import numpy as np

from legacy_reference import run_reference

#: The strategy models' layers: (tf.layers code, in the reference's terms).
STRATEGY_LAYERS = {
    'function': "layers.batch_normalization(x, training=True, momentum=0.9, name='bn')",
    'object': "layers.BatchNormalization(momentum=0.9, axis=[-1], name='bn')"
              ".apply(x, training=True)",
}

SCRIPT = '''
import json, os, runpy, sys
import numpy as np
import tensorflow as tf
tf1 = tf.compat.v1
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from parity_harness import train_case
import layers_cases
from layers_cases import PARITY_CASES, SCENARIOS, parity_apply, run_scenario
import getter_case
import strategy_case

layers = tf1.layers
assert layers.batch_normalization.__module__.startswith('tf_keras'), layers.batch_normalization
out = sys.argv[1]
arrays, infos, errors = {}, [], {}


def keep(prefix, values):
    arrays.update({prefix + '|' + k: v for k, v in values.items()})


for index, case in enumerate(PARITY_CASES):
    apply = lambda x, w, training, tower, towers, case=case: parity_apply(
        layers, case, x, training, tower)
    try:
        values, info = train_case(apply, case, index, [case['shape'][0]])
    except Exception as e:  # reported by the case's tests
        values, info = {}, {'error': '%s: %s' % (type(e).__name__, str(e)[:2000])}
    keep('parity/%d' % index, values)
    infos.append(info)
scenarios = {}
for name in SCENARIOS:
    try:
        scenarios[name] = run_scenario(layers, name)
    except Exception as e:
        scenarios[name] = {'error': '%s: %s' % (type(e).__name__, str(e)[:2000])}
for name, code in json.loads(sys.argv[2]).items():
    keep('strategy/' + name, strategy_case.train(eval('lambda x: ' + code), [8]))
layer = eval('lambda x: ' + json.loads(sys.argv[2])['function'])
checkpoint = os.path.abspath('tf_layers_checkpoint')
strategy_case.train(layer, [8], checkpoint_out=checkpoint)
keep('restored', strategy_case.train(layer, [8], checkpoint_in=checkpoint))
sys.argv = ['tf_layers_script.py', '1', os.path.abspath('script.npz')]
runpy.run_path(os.path.join(os.path.dirname(layers_cases.__file__), 'tf_layers_script.py'),
               run_name='__main__')
getter_arrays, getter_errors = getter_case.run_legacy_cases()
for key, values in getter_arrays.items():
    keep(key, values)
np.savez(out + '.npz', **arrays)
with open(out + '.json', 'w') as f:
    json.dump({'infos': infos, 'scenarios': scenarios, 'checkpoint': checkpoint,
               'getter_errors': getter_errors}, f)
print('RESULT ' + out)
'''

_CACHE = {}

#: Where a child pytest (``without_onednn``) finds its parent's reference run.
REFERENCE_DIR_VARIABLE = 'TF1_SYNCBN_TEST_LAYERS_REFERENCE'


def reference_dir(tmp_path_factory):
    """Runs the reference (once per process, not in a child of a run that did); its directory."""
    if 'dir' not in _CACHE:
        if os.environ.get(REFERENCE_DIR_VARIABLE):
            _CACHE['dir'] = pathlib.Path(os.environ[REFERENCE_DIR_VARIABLE])
        else:
            tmp = tmp_path_factory.mktemp('tf_layers_reference')
            run_reference(SCRIPT, tmp, args=[str(tmp / 'reference'),
                                             json.dumps(STRATEGY_LAYERS)], timeout=600)
            _CACHE['dir'] = tmp
    return _CACHE['dir']


def reference(tmp_path_factory):
    """Runs the reference (once per process); returns its results.

    Returns:
      A dict: ``parity`` (per case of ``PARITY_CASES``: ``(arrays, info)``),
      ``scenarios`` (name -> record), ``strategy`` (name -> arrays),
      ``restored`` (arrays), ``checkpoint`` (its path), ``script`` (arrays of
      ``tf_layers_script.py`` on one tower), ``script_api`` (its record),
      ``getter`` (``getter_case.legacy_key`` -> arrays) and ``getter_errors``
      (``getter_case.legacy_key`` -> the error of a case that failed).
    """
    if 'results' not in _CACHE:
        _CACHE['results'] = _load(reference_dir(tmp_path_factory))
    return _CACHE['results']


def _load(tmp):
    loaded = np.load(tmp / 'reference.npz')
    meta = json.loads((tmp / 'reference.json').read_text())
    results = {'parity': [({}, info) for info in meta['infos']], 'strategy': {},
               'restored': {}, 'scenarios': meta['scenarios'],
               'checkpoint': meta['checkpoint'], 'getter': {},
               'getter_errors': meta['getter_errors']}
    for key in loaded.files:
        prefix, name = key.split('|', 1)
        if prefix.startswith('getter:'):
            results['getter'].setdefault(prefix, {})[name] = loaded[key]
        elif prefix.startswith('parity/'):
            results['parity'][int(prefix.split('/')[1])][0][name] = loaded[key]
        elif prefix.startswith('strategy/'):
            results['strategy'].setdefault(prefix.split('/')[1], {})[name] = loaded[key]
        else:
            results[prefix][name] = loaded[key]
    script = np.load(tmp / 'script.npz')
    results['script'] = {k: script[k] for k in script.files}
    results['script_api'] = json.loads((tmp / 'script.json').read_text())
    return results
