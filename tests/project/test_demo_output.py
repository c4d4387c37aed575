"""What the demo prints as a user runs it: the comparison run's audit, and a whole progress bar.

Before: the per-tower run's audit ended in "FAILED: 4 problems.", although
that run normalizes each tower alone on purpose (it is the comparison); and
TensorFlow's ``Saver``, deleting a checkpoint beyond ``max_to_keep``, logged a
deprecation warning about its own call into the middle of the progress
bar's line. Each script runs as ``python script.py`` would, forked from one
TensorFlow import (tests/support/forked.py). The demo sets its own TF
behaviour, so these run in the TF2-behaviour pass only. (The audit lines
themselves, and a real problem of the per-tower run still printed as
FAILED: tests/audit/test_audit.py.)
"""

import os
import re

import pytest

import forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, 'examples')
# As test_readme.py's: one zygote (one TensorFlow import) serves both.
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
           PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))


def _run(argv, folder):
    status, stdout, stderr = forked.run_python(argv, folder, ENV, timeout=300)
    assert status == 0, 'exit %d:\n%s\n%s' % (status, stdout[-3000:], stderr[-3000:])
    return stdout, stderr


@pytest.mark.once
def test_the_demo_says_the_per_tower_run_is_the_comparison_and_logs_no_deprecation(tmp_path):
    # 3 checkpoints per run, 2 kept: the Saver deletes the first (remove_checkpoint).
    stdout, stderr = _run([os.path.join(EXAMPLES, 'train_multitower.py'), '--towers', '2',
                           '--steps', '3', '--save-every', '1', '--eval-every', '3',
                           '--min-accuracy', '0', '--out-dir', tmp_path / 'out'], tmp_path)
    for run in ('sync', 'per_tower'):
        assert not (tmp_path / 'out' / run / 'model.ckpt-1.index').exists()
        assert (tmp_path / 'out' / run / 'model.ckpt-3.index').exists()
    assert 'sync: batch-norm audit' in stdout and 'OK: no problems found.' in stdout
    assert ('per-tower run: 4 layers unsynchronized, as intended for the comparison; '
            'nothing else found.\n') in stdout, stdout
    assert 'FAILED' not in stdout
    assert 'deprecated' not in stdout + stderr, stderr


# TensorFlow's warnings go to stderr, the bar to stdout: on a terminal both
# reach the same screen, so the script sends them into one file, in order.
_BAR_SCRIPT = '''
import os
import sys

os.dup2(1, 2)
sys.path.insert(0, %r)
import tensorflow as tf
import train_multitower as demo

with demo.progress_bar(3, 0, 'bar') as bar:
    bar.update(1)
    bar.refresh()
    tf.get_logger().warning('a warning while the bar runs')
    bar.update(2)
print('end')
'''


@pytest.mark.once
def test_a_tensorflow_warning_prints_above_the_progress_bar_not_into_it(tmp_path):
    script = tmp_path / 'bar.py'
    script.write_text(_BAR_SCRIPT % EXAMPLES)
    output, _ = _run([script], tmp_path)
    # The record starts a line of its own (the bar cleared with '\r'), whole; the bar
    # is drawn again below it. Before: 'bar:  33%|...| 1/3 [...]WARNING:tensorflow:...'.
    assert re.search(r'[\r\n]WARNING:tensorflow:a warning while the bar runs\n', output), \
        repr(output)
    after = output.split('a warning while the bar runs\n', 1)[1]
    assert re.search(r'bar: +100%.*3/3', after) and after.endswith('end\n'), repr(output)
