"""tf-slim's own BatchNormTest, run against sync_batch_norm.

tf-slim 1.1 ships its tests (``tf_slim/layers/layers_test.py``); its
``BatchNormTest`` (67 tests: op names, variables and collections, updates
with and without ``UPDATE_OPS``, a tensor ``is_training``, fused and not,
NHWC and NCHW, renorm, adjustment, zero-debias, frozen statistics, ...) is
the specification of the layer this library replaces. Here it runs in a
subprocess with legacy Keras (which tf-slim's test module needs), with its
``batch_norm`` swapped for ``sync_batch_norm``.

One difference is kept on purpose: an unknown ``data_format`` raises a
``ValueError`` that names the formats this layer accepts (``NDHWC``,
``channels_first``, ... as well), not slim's "data_format has to be either
NCHW or NHWC."
"""

import json

from legacy_reference import run_reference

SCRIPT = '''
import json, sys, unittest
import tensorflow as tf
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from tf_slim.layers import layers_test
from tf1_syncbn import sync_batch_norm
if sys.argv[1] == 'ours':
    layers_test._layers.batch_norm = sync_batch_norm
suite = unittest.TestLoader().loadTestsFromTestCase(layers_test.BatchNormTest)
result = unittest.TextTestRunner(verbosity=0, stream=sys.stderr).run(suite)
failed = {t.id().split('.')[-1]: tb.strip().splitlines()[-1][:300]
          for t, tb in result.failures + result.errors}
print('RESULT ' + json.dumps({'ran': result.testsRun, 'failed': failed,
                              'skipped': len(result.skipped)}))
'''

#: Failures kept on purpose (see the module docstring).
EXPECTED_FAILURES = {'testInvalidDataFormat'}


def _run(tmp_path, which):
    out = run_reference(SCRIPT, tmp_path, args=[which], timeout=300)
    line = [l for l in out.splitlines() if l.startswith('RESULT ')][-1]
    return json.loads(line[len('RESULT '):])


def test_slims_own_batch_norm_tests_pass_on_sync_batch_norm(tmp_path):
    result = _run(tmp_path, 'ours')
    assert result['ran'] >= 60, result
    assert set(result['failed']) == EXPECTED_FAILURES, result['failed']


def test_the_swap_is_real(tmp_path):
    """slim itself, on TensorFlow 2.21, fails other tests and passes the wording one.

    So the run above really tested sync_batch_norm: tf-slim 1.1 fails a few of
    its own tests on TensorFlow 2.21 (its zero-debias path with a tensor
    ``is_training`` calls ``control_flow_ops.cond``, which TensorFlow removed),
    which this library passes.
    """
    result = _run(tmp_path, 'slim')
    assert result['ran'] >= 60, result
    assert 'testInvalidDataFormat' not in result['failed']
    assert result['failed'] and all("has no attribute 'cond'" in message
                                    for message in result['failed'].values()), result
