"""The Horovod backend, run by Horovod itself, equals the replaced layer on one device.

Two processes under ``horovodrun --gloo`` (``parity_worker.py``), each with
one tower (Horovod's convention) or two (``TowerContext`` on virtual CPUs),
build this library's three front-ends with ``sync_statistics='horovod'``:
``sync_batch_norm`` for ``slim.batch_norm``, ``tf1_syncbn.BatchNorm`` for
tensorpack's ``BatchNorm``, ``tf1_syncbn.layers`` for
``tf.compat.v1.layers.batch_normalization``. Their outputs, input and
parameter gradients, every variable (moving statistics included) over three
SGD steps, and inference afterwards equal what tf-slim, tensorpack and
tf.layers themselves compute on one device with the concatenated batch
(``horovod_cases.reference_dir``: one legacy-Keras subprocess in the same TF
behaviour), with uneven members, an empty tower and an empty process,
float16 and bfloat16, renorm, batch weights, ghost batches, a bool-tensor
``training``; with the tolerances of the parity suites
(``parity_harness.assert_same_numbers``). The gradients flow back through
Horovod's all-reduces: the layer's backward all-reduce (fused path) and the
differentiable global moments (renorm, batch weights, ``fused=False``).
"""

import json

import numpy as np
import pytest

import reference_cases
from parity_harness import assert_same_numbers

from . import horovod_cases
from .horovod_cases import CASES, PROCESSES
from .horovod_run import horovodrun

pytestmark = pytest.mark.timeout(900)

RUNS = horovod_cases.runs()
IDS = ['%s@%s' % (CASES[index]['name'], layout) for index, layout, _, _ in RUNS]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """``[(arrays, info)]`` per case: the replaced libraries on one device."""
    return reference_cases.load(horovod_cases.reference_dir(tmp_path_factory), CASES)


@pytest.fixture(scope='module')
def job(tmp_path_factory):
    """Every run's records, per process: ``[(arrays by run, info by run)]``."""
    out = tmp_path_factory.mktemp('horovod_parity')
    horovod_cases.write_job(out)
    horovodrun('parity_worker.py', [out], np=PROCESSES, timeout=800).check()
    ranks = []
    for rank in range(PROCESSES):
        loaded = np.load(out / ('rank%d.npz' % rank))
        meta = json.loads((out / ('rank%d.json' % rank)).read_text())
        assert meta['size'] == PROCESSES
        arrays = {}
        for key in loaded.files:
            run, name = key.split('|', 1)
            arrays.setdefault(run, {})[name] = loaded[key]
        ranks.append((arrays, meta['runs']))
    return ranks


def _merged(job, run, ref):
    """Each process's arrays, with ``y`` and ``dx`` gathered from every process's rows."""
    per_rank = []
    for arrays, infos in job:
        if 'error' in infos[run]:
            pytest.fail('a process failed: %s' % infos[run]['error'])
        per_rank.append(arrays[run])
    gathered = {}
    for key in ref:
        if key.startswith(('y/', 'dx/')):
            out = np.full(ref[key].shape, np.nan, np.float32)
            for arrays in per_rank:
                out[arrays['rows']] = arrays[key]
            gathered[key] = out
    return [dict({k: v for k, v in arrays.items() if k != 'rows'
                  and not k.startswith(('y/', 'dx/'))}, **gathered) for arrays in per_rank]


@pytest.mark.parametrize('run', RUNS, ids=IDS)
def test_processes_equal_the_replaced_layer_on_the_concatenated_batch(reference, job, run):
    index, layout, towers, sizes = run
    case = CASES[index]
    ref, ref_info = reference[index]
    if 'error' in ref_info:
        pytest.fail('the replaced library itself failed: %s' % ref_info['error'])
    name = IDS[RUNS.index(run)]
    for rank, ours in enumerate(_merged(job, name, ref)):
        case_here = dict(case, name='%s, process %d' % (name, rank))
        assert_same_numbers(ours, ref, case_here, len(sizes))
        info = job[rank][1][name]
        assert info['global_variables'] == ref_info['global_variables']
        assert info['trainable_variables'] == ref_info['trainable_variables']
        if not case.get('training_tensor'):   # (v2 control flow keeps a cond's ops in functions)
            # One all-reduce each way per tower, and one per parameter gradient;
            # several towers of a process first sum locally (one collective each way).
            # Ghost batches on dynamic batch sizes: one more per tower, of the
            # members' batch sizes, checked equal before the ghost all-reduce
            # (tf1_syncbn._sync.ghost_batches).
            size_checks = towers if case.get('interleave') else 0
            assert info['horovod_allreduces'] == (2 * towers + len(info['trainable_variables'])
                                                  + size_checks)
            assert info['collectives'] == (2 * towers + size_checks if towers > 1 else 0)


@pytest.mark.once      # the TF2-behaviour pass runs every case (horovod_cases._V1: TF1's)
def test_every_front_end_layout_and_type_ran():
    """What the runs cover (so that trimming the cases cannot drop a claim silently)."""
    fronts = {CASES[i]['front_end'] for i, _, _, _ in RUNS}
    assert fronts == {'slim', 'tensorpack', 'layers'}
    for front in fronts:
        layouts = {(towers, tuple(sizes)) for i, _, towers, sizes in RUNS
                   if CASES[i]['front_end'] == front}
        assert {t for t, _ in layouts} == {1, 2}
        assert any(0 in sizes for _, sizes in layouts)                        # an empty tower
        assert any(sum(sizes[r * t:(r + 1) * t]) == 0                        # an empty process
                   for t, sizes in layouts for r in range(PROCESSES))
        dtypes = {CASES[i].get('dtype') for i, _, _, _ in RUNS if CASES[i]['front_end'] == front}
        assert {'float16', 'bfloat16'} <= dtypes
