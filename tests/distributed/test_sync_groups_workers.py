"""Sync groups across worker processes: 2 workers x 2 towers on localhost, one short job.

Per-worker groups (``group_size=2``), groups across the workers
(``[[0, 2], [1, 3]]``), each tower alone (``group_size=1``) and one tower alone
next to a group of three (``[[0], [1, 2, 3]]``, ``[[0, 1, 2], [3]]``), in one
graph (``tests/support/for_distributed/sync_groups_workers.py``): every tower's outputs and
input gradients equal float64 batch norm on its group's concatenated batch, and every worker's
moving statistics are those of worker 0's main tower's group (global tower 0),
identical on both workers.
"""

import json
import os
import sys

import numpy as np

import support_paths
import sync_groups_workers as job
import tf_behavior
from bn_reference import bn_backward, bn_forward
from tf1_syncbn.launch import Launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(ROOT, 'tests', 'support', 'for_distributed')

EPS = 1e-3
#: layer -> its groups of global towers
GROUPS = {'per_worker': [[0, 1], [2, 3]], 'across': [[0, 2], [1, 3]],
          'alone': [[0], [1], [2], [3]], 'first_alone': [[0], [1, 2, 3]],
          'last_alone': [[0, 1, 2], [3]]}


def test_two_workers_of_two_towers_in_groups_equal_their_groups_references():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
               PYTHONPATH=support_paths.pythonpath(os.environ.get('PYTHONPATH')))
    launcher = Launcher([sys.executable, os.path.join(SUPPORT, 'sync_groups_workers.py')] +
                        tf_behavior.flag(), 2, env=env, output=None).start()
    status = launcher.wait(timeout=300)
    text = '\n'.join(line for lines in launcher.lines for line in lines)
    assert status == 0, text[-4000:]
    results = {}
    for lines in launcher.lines:
        for line in lines:
            if line.startswith('RESULT '):
                result = json.loads(line[len('RESULT '):])
                results[result['rank']] = result['layers']
    assert sorted(results) == [0, 1], text[-4000:]
    data, upstream = (a.astype(np.float64) for a in job.global_batch())
    ones, zeros = np.ones(job.SHAPE[-1]), np.zeros(job.SHAPE[-1])
    rows = [slice(job.START[g], job.START[g] + job.SIZES[g]) for g in range(4)]
    for name, groups in GROUPS.items():
        for members in groups:
            x = np.concatenate([data[rows[g]] for g in members])
            dy = np.concatenate([upstream[rows[g]] for g in members])
            y, dx = bn_forward(x, ones, zeros, EPS)['y'], bn_backward(dy, x, ones, EPS)['dx']
            offset = 0
            for g in members:
                got = results[g // 2][name]
                n = job.SIZES[g]
                np.testing.assert_allclose(got['outputs'][g % 2], y[offset:offset + n],
                                           rtol=1e-4, atol=1e-4, err_msg='%s %d' % (name, g))
                np.testing.assert_allclose(got['input_grads'][g % 2], dx[offset:offset + n],
                                           rtol=1e-3, atol=1e-4, err_msg='%s %d' % (name, g))
                offset += n
        # The moving statistics: global tower 0's group, on both workers, identical.
        ref = bn_forward(np.concatenate([data[rows[g]] for g in groups[0]]), ones, zeros, EPS)
        assert results[0][name]['moving'] == results[1][name]['moving'], name
        mean, variance = (np.asarray(v) for v in results[0][name]['moving'])
        np.testing.assert_allclose(mean, (1 - job.DECAY) * ref['mean'], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(variance, job.DECAY + (1 - job.DECAY) * ref['var_unbiased'],
                                   rtol=1e-4, atol=1e-5, err_msg=name)
