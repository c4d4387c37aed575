"""A parity module's cases, run with the replaced layer in one legacy-Keras subprocess.

The parity modules (``test_parity_slim``, ``test_parity_tensorpack``,
``test_claims_renorm``, ``test_layers_virtual_batch``) share one shape: a
``MODEL`` source that defines the layer function both sides call (the test
``exec``s it too), a list of JSON-able cases, and one subprocess
(``legacy_reference.run_reference``) that trains every case with tf-slim,
tensorpack or tf.layers itself on one device (``parity_harness.train_case``).
:func:`reference_dir` runs it and :func:`load` reads it back. A case that
fails in the reference records its error, which that case's tests report.

A child pytest of the module (``without_onednn``) finds its parent's run
through the module's environment variable instead of running it again.
"""

import json
import os
import pathlib

import numpy as np
import pytest

from legacy_reference import run_reference

_HEADER = '''
import json
import numpy as np
import pytest
import tensorflow as tf
tf1 = tf.compat.v1
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from parity_harness import train_case
'''

_LOOP = '''
cases = json.loads(open('cases.json').read())
arrays, infos = {}, []
for index, case in enumerate(cases):
    try:
        case_arrays, info = train_case(lambda *args, case=case: reference_apply(case, *args),
                                       case, index, [case['shape'][0]])
    except Exception as e:  # reported by the case's tests
        case_arrays, info = {}, {'error': '%s: %s' % (type(e).__name__, str(e)[:2000])}
    arrays.update({'%d/%s' % (index, k): v for k, v in case_arrays.items()})
    infos.append(info)
np.savez('reference.npz', **arrays)
open('reference.json', 'w').write(json.dumps(infos))
print('RESULT reference.npz')
'''


def reference_dir(tmp_path_factory, name, cases, model, apply, variable=None, timeout=600):
    """Runs every case with the replaced layer, in one subprocess; returns its directory.

    Args:
      tmp_path_factory: pytest's.
      name: the directory's name.
      cases: the module's cases (JSON-able dicts).
      model: source that defines the module's layer function(s).
      apply: source, run after ``model``, that imports the replaced library
        and defines ``reference_apply(case, x, weights, training, tower,
        towers)``, the layer on one device.
      variable: the environment variable through which a child run of the
        module finds this directory (then nothing is run).
      timeout: of the subprocess, in seconds.
    """
    if variable and os.environ.get(variable):
        return pathlib.Path(os.environ[variable])
    tmp = tmp_path_factory.mktemp(name)
    (tmp / 'cases.json').write_text(json.dumps(cases))
    run_reference(_HEADER + model + apply + _LOOP, tmp, timeout=timeout)
    return tmp


def load(directory, cases):
    """``[(arrays, info)]``, one per case; ``info['error']`` where the reference failed."""
    directory = pathlib.Path(directory)
    ran = json.loads((directory / 'cases.json').read_text())
    if ran != json.loads(json.dumps(cases)):
        raise RuntimeError('%s holds a run of other cases than this module\'s' % directory)
    arrays = np.load(directory / 'reference.npz')
    results = [({}, info) for info in json.loads((directory / 'reference.json').read_text())]
    for key in arrays.files:
        index, name = key.split('/', 1)
        results[int(index)][0][name] = arrays[key]
    return results


def load_arrays(directory, cases, library):
    """``[arrays]``, one per case; fails the test when ``library`` failed on any case."""
    results = load(directory, cases)
    failed = {case['name']: info['error'] for case, (_, info) in zip(cases, results)
              if 'error' in info}
    if failed:
        pytest.fail('%s itself failed: %s' % (library, failed))
    return [arrays for arrays, _ in results]
