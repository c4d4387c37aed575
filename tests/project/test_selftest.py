"""The self-test module: passes on virtual CPUs, catches an injected mismatch, CLI works."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tf_behavior
from tf1_syncbn import selftest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize('towers', [2, 3, 4])
def test_collective_passes_on_virtual_cpus(towers):
    result = selftest.run_check('collective', towers=towers, steps=2, device='cpu')
    assert result.status == 'PASS', result.message
    assert result.failed == []
    assert sorted(result.errors) == sorted(selftest.QUANTITIES)
    assert max(result.errors.values()) < 1e-4
    assert len(set(result.batch_sizes)) > 1, 'batches must be uneven'
    assert result.devices == ['/cpu:%d' % i for i in range(towers)]
    assert result.step_time > 0


def test_empty_tower_and_custom_sizes_pass():
    result = selftest.run_check('collective', towers=3, batch_sizes=[4, 0, 3], steps=1,
                                device='cpu')
    assert result.status == 'PASS', result.message


def test_injected_mismatch_fails():
    result = selftest.run_check('collective', towers=2, steps=1, device='cpu', perturb=1e-2)
    assert result.status == 'FAIL'
    assert 'output' in result.failed
    # Adding a constant changes no gradient: only the output is reported.
    assert result.failed == ['output']
    assert result.errors['output'] == pytest.approx(1e-2, rel=1e-3)
    assert 'mismatch in output' in result.message


def test_main_returns_nonzero_on_mismatch(monkeypatch, capsys):
    real = selftest.run_check

    def perturbed(*args, **kwargs):
        kwargs['perturb'] = 0.5
        return real(*args, **kwargs)

    monkeypatch.setattr(selftest, 'run_check', perturbed)
    code = selftest.main(['--towers', '2', '--backend', 'collective', '--device', 'cpu',
                          '--steps', '1'])
    out = capsys.readouterr().out
    assert code == 1
    assert 'FAIL' in out
    assert 'mismatch in output' in out


def test_main_passes_and_skips_nccl_without_gpu(capsys):
    code = selftest.main(['--towers', '2', '--device', 'cpu', '--steps', '1'])
    out = capsys.readouterr().out
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines['collective'].rstrip().endswith('PASS')
    assert lines['auto'].rstrip().endswith('PASS')
    assert lines['nccl'].rstrip().endswith('SKIP')
    assert 'NCCL needs one GPU per tower' in out
    assert 'PASS: collective, auto (skipped: nccl)' in out


@pytest.mark.skipif(bool(tf.config.list_physical_devices('GPU')),
                    reason='checks what happens on a machine without GPUs')
def test_main_fails_when_it_checked_nothing(capsys):
    # --backend nccl without GPUs checks nothing: that must not look like a pass.
    code = selftest.main(['--towers', '2', '--backend', 'nccl', '--steps', '1'])
    out = capsys.readouterr().out
    assert code == 1
    assert 'SKIPPED: no requested backend can run here; nothing was checked.' in out


def test_nccl_on_cpu_towers_is_skipped():
    result = selftest.run_check('nccl', towers=2, device='cpu')
    assert result.status == 'SKIP'
    assert result.errors == {}


@pytest.mark.parametrize('kwargs', [
    dict(backend='horovod'),
    dict(backend='collective', towers=0),
    dict(backend='collective', steps=0),
    dict(backend='collective', towers=2, batch_sizes=[1, 2, 3]),
    dict(backend='collective', towers=2, batch_sizes=[1, 0]),
    dict(backend='collective', device='tpu'),
])
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        selftest.run_check(**kwargs)


def test_cli_exits_zero():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    proc = subprocess.run(
        [sys.executable, '-m', 'tf1_syncbn.selftest', '--towers', '2', '--backend',
         'collective'] + tf_behavior.flag(), cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'PASS: collective' in proc.stdout
    assert 'output' in proc.stdout and 'moving_var' in proc.stdout
