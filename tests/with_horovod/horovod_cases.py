"""The parity cases run under Horovod: three front-ends, 2 processes x 1 and x 2 towers.

Each case is one of the front-end parity modules' own cases
(``slim/test_slim_parity``, ``tensorpack/test_tensorpack_parity``, ``layers_cases``), with
``front_end`` added and its name prefixed; both sides build it with those
modules' layer functions (``slim_apply``, ``tensorpack_apply``,
``parity_apply``): the replaced library on one device in the reference
subprocess (:func:`reference_dir`), this library on every tower of every
Horovod process in ``parity_worker.py``.

A *layout* says how the global batch of a case is split: ``towers`` per
process and the batch size of every member, process-major (member
``rank * towers + t`` is tower ``t`` of process ``rank``). Uneven, and with
an empty tower or an empty process.
"""

import copy
import importlib
import json
import os
import sys

import reference_cases
import tf_behavior

#: Processes of every job.
PROCESSES = 2

_FROM = {
    'slim': ('fused=None-rank4-NHWC', 'fused=False-rank2-NHWC', 'batch_weights-rank4',
             'renorm-rank4', 'float16-rank4', 'bfloat16-rank4-NCHW', 'mean1e4-rank4',
             'training_tensor-rank4'),
    'tensorpack': ('4d-channels_last', '2d', '4d-bfloat16-channels_first', '2d-float16',
                   'renorm-4d-channels_last', '2d-ghost'),
    'layers': ('rank4-axis3', 'rank3-axis1', 'float16-rank4', 'bfloat16-rank3',
               'rank5-axis-4-object', 'renorm-clipped-rank4-axis1'),
}
# The TF1-behaviour pass (tf_behavior.pick) runs 8 of the 20: each front-end's
# first case (the fast path, Dimension shapes, the empty layouts), the slow
# paths that read reference variables in the step (slim's batch weights,
# tensorpack's and tf.layers' renorm), tensorpack's ghost batches, slim's
# bool-tensor training (v1 tf.cond). Horovod's all-reduces are the same ops in
# either behaviour; the 16-bit types and the large mean change no TF1 path.
_V1 = ('slim/fused=None-rank4-NHWC', 'slim/batch_weights-rank4', 'slim/training_tensor-rank4',
       'tensorpack/4d-channels_last', 'tensorpack/renorm-4d-channels_last', 'tensorpack/2d-ghost',
       'layers/rank4-axis3', 'layers/renorm-clipped-rank4-axis1')

#: name -> (towers per process, sizes of the members); every case runs each.
LAYOUTS = {
    '2x1': (1, [3, 5]),
    '2x2': (2, [3, 0, 1, 4]),
}
#: Layouts with an empty process, run on the first case of each front-end.
EMPTY_LAYOUTS = {
    '2x1-empty-rank0': (1, [0, 8]),
    '2x2-empty-rank1': (2, [5, 3, 0, 0]),
}
#: Ghost batch norm: every member holds equal runs of each virtual batch.
GHOST_LAYOUTS = {
    '2x1': (1, [4, 4]),
    '2x2': (2, [2, 2, 2, 2]),
}


#: The parity modules whose cases and layer functions the Horovod job takes.
PARITY_MODULES = {'slim': ('slim', 'test_slim_parity'),
                  'tensorpack': ('tensorpack', 'test_tensorpack_parity')}
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parity_module(front_end):
    """The front-end's parity module (tests/<folder>/test_<front-end>_parity.py)."""
    folder, name = PARITY_MODULES[front_end]
    path = os.path.join(TESTS, folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def _source_cases(front_end):
    if front_end in PARITY_MODULES:
        return _parity_module(front_end).ALL_CASES
    from layers_cases import ALL_PARITY_CASES  # noqa: PLC0415
    return ALL_PARITY_CASES


def _cases():
    cases = []
    for front_end, names in _FROM.items():
        by_name = {c['name']: c for c in _source_cases(front_end)}
        for name in names:
            case = copy.deepcopy(by_name[name])
            case['name'] = '%s/%s' % (front_end, name)
            case['front_end'] = front_end
            cases.append(case)
    return cases


_ALL_CASES = _cases()
#: The cases of this pass (every case in TF2 behaviour).
CASES = tf_behavior.pick(_ALL_CASES, [c for c in _ALL_CASES if c['name'] in _V1])


def runs():
    """``[(case index, layout name, towers, sizes)]``: every run of the parity job."""
    out, seen = [], set()
    for index, case in enumerate(CASES):
        layouts = dict(GHOST_LAYOUTS if case.get('interleave') else LAYOUTS)
        if case['front_end'] not in seen:
            seen.add(case['front_end'])
            layouts.update(EMPTY_LAYOUTS)
        for name, (towers, sizes) in layouts.items():
            assert len(sizes) == towers * PROCESSES and sum(sizes) == case['shape'][0]
            out.append((index, name, towers, sizes))
    return out


#: The layer functions both sides call (the parity modules' own).
def model_source():
    return (_parity_module('slim').MODEL + _parity_module('tensorpack').MODEL
            + '\nfrom layers_cases import parity_apply\n')


REFERENCE_APPLY = '''
import tf_slim as slim
import tensorpack.models as tensorpack_layers
from tensorpack.tfutils.tower import TowerContext as TensorpackTowerContext

assert tf1.layers.batch_normalization.__module__.startswith('tf_keras')


def reference_apply(case, x, weights, training, tower, towers):
    """The replaced layer itself, on one device."""
    if case['front_end'] == 'slim':
        return slim_apply(slim.batch_norm, case, x, weights, training, tower, towers)
    if case['front_end'] == 'tensorpack':
        # tensorpack's layers read their mode from its tower context.
        with TensorpackTowerContext('', is_training=tower is not None):
            return tensorpack_apply(tensorpack_layers, case, x, training, tower)
    return parity_apply(tf1.layers, case, x, training, tower)
'''


def write_job(directory):
    """Writes ``directory/job.json``: what ``parity_worker.py`` runs (cases, runs, layer functions).

    The workers read it instead of importing the parity test modules.
    """
    (directory / 'job.json').write_text(json.dumps(
        {'cases': CASES, 'runs': runs(), 'model': model_source()}))


def reference_dir(tmp_path_factory):
    """Every case with tf-slim, tensorpack and tf.layers themselves, in one subprocess."""
    return reference_cases.reference_dir(tmp_path_factory, 'horovod_reference', CASES,
                                         model_source(), REFERENCE_APPLY)
