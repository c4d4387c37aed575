"""Synchronization across worker processes (collective ops over localhost)."""

import os
import subprocess
import sys

import pytest

import tf_behavior

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.once(reason="the example script's own run; the library's multi-worker paths in "
                        'TF1 behaviour are test_multi_worker_training\'s (2 x 2 against 1 x 4)')
def test_two_workers_of_two_towers_equal_the_global_batch():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'examples', 'multi_worker.py'), '--workers', '2',
         '--towers', '2', '--timeout', '60'] + tf_behavior.flag(),
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert 'PASS' in proc.stdout


def test_checker_detects_a_wrong_worker():
    sys.path.insert(0, os.path.join(ROOT, 'examples'))
    try:
        import multi_worker
    finally:
        sys.path.pop(0)
    data, upstream = multi_worker.global_batch(2, 1)
    wrong = {'task': 1, 'outputs': [data[5:].tolist()], 'input_grads': [upstream[5:].tolist()],
             'moving_variance': [1.0] * 3}
    assert multi_worker.check([wrong], 2, 1) > 1e-2
