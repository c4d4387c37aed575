"""The demo's runs move and resume: relative checkpoint paths, and --resume that refuses clearly.

The resume runs as a user runs it (``python examples/train_multitower.py
...``, a fresh process); the run it resumes, and the refusals (which happen
before anything is built), through the script's ``main`` in the test
process. Before: the ``checkpoint`` file stored absolute paths, so a run
folder moved elsewhere restarted from step 0 with only a logged TensorFlow
error; ``--resume`` on a folder without checkpoints started afresh without a
word; and ``--resume`` with another number of towers changed the global
batch silently.

The demo sets its own TF behaviour (TF2 behaviour, graph mode), so these
run in the suite's ``v2`` pass only.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import tf_behavior

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, 'examples', 'train_multitower.py')
COMMON = ['--eval-every', '2', '--save-every', '2', '--min-accuracy', '0']
TIMEOUT_S = 300


def _demo(*args):
    # (--tf1-behavior in the TF1-behaviour pass.)
    return subprocess.run([sys.executable, DEMO] + COMMON + tf_behavior.flag() + list(args),
                          cwd=ROOT, text=True,
                          capture_output=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))


@pytest.fixture(scope='module')
def moved_run(tmp_path_factory):
    """A 4-step run (the script's main, in this process), moved to another folder after it.

    The resume that follows is a fresh process, as a user's is: it never saw
    the folder where the run was trained.
    """
    first = tmp_path_factory.mktemp('first')
    assert _demo_module().main(COMMON + tf_behavior.flag() +
                               ['--steps', '4', '--out-dir', str(first / 'run')]) == 0
    moved = tmp_path_factory.mktemp('elsewhere') / 'moved'
    shutil.move(str(first / 'run'), str(moved))
    return str(moved)


def test_a_moved_run_folder_resumes_where_it_stopped(moved_run):
    for name in ('sync', 'per_tower'):
        with open(os.path.join(moved_run, name, 'checkpoint')) as f:
            assert os.sep not in f.read()          # relative paths only
    run = _demo('--steps', '6', '--out-dir', moved_run, '--resume')
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ('sync', 'per_tower'):
        assert '%-9s resumed at step 4 from %s' % (
            name, os.path.join(moved_run, name, 'model.ckpt-4')) in run.stdout, run.stdout
    with open(os.path.join(moved_run, 'metrics.json')) as f:
        metrics = json.load(f)
    assert [metrics['runs'][name]['start_step'] for name in ('sync', 'per_tower')] == [4, 4]
    assert len(metrics['runs']['sync']['loss']) == 6     # 4 restored from history.json + 2


def _demo_module():
    sys.path.insert(0, os.path.dirname(DEMO))
    try:
        import train_multitower
    finally:
        sys.path.pop(0)
    return train_multitower


# The refusals come from the script's main() before anything is built, so these
# call it here (as `python train_multitower.py ...` does) instead of paying for
# another TensorFlow process each.

def test_resume_without_a_checkpoint_fails_naming_the_folder(tmp_path, capsys):
    empty = str(tmp_path / 'nothing here')
    assert _demo_module().main(COMMON + ['--steps', '4', '--out-dir', empty, '--resume']) == 2
    err = capsys.readouterr().err
    assert '--resume: %s holds no checkpoint to resume from' % empty in err, err
    assert not os.path.exists(os.path.join(empty, 'sync'))     # nothing was started


def test_resume_with_another_global_batch_refuses_and_says_what_changes(moved_run, capsys):
    assert _demo_module().main(COMMON + ['--steps', '6', '--out-dir', moved_run, '--resume',
                                         '--towers', '2']) == 2
    out = capsys.readouterr()
    assert ('was trained with global batch 8 (1 worker x 4 towers x 2 examples per tower), '
            'seed 0; this job has global batch 4 (1 worker x 2 towers x 2 examples per tower)'
            in out.err), out.err
    assert 'resumed' not in out.out


def test_resume_with_fewer_steps_than_trained_refuses(moved_run, capsys):
    # The run trained 4 steps (6 once resumed above): --steps 3 would train
    # nothing and mix its metrics.
    assert _demo_module().main(COMMON + ['--steps', '3', '--out-dir', moved_run,
                                         '--resume']) == 2
    out = capsys.readouterr()
    trained = re.search(r'has trained (\d+) steps already; --steps 3 would train none', out.err)
    assert trained and int(trained.group(1)) >= 4, out.err
    assert 'Pass --steps %s or more' % trained.group(1) in out.err, out.err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        _demo_module().parse_args(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    defaults = (('--towers', 4), ('--batch-per-tower', 2), ('--steps', 900),
                ('--backend', 'auto'), ('--out-dir', 'demo_out/'), ('--seed', 0), ('--lr', 0.05),
                ('--eval-every', 50), ('--save-every', 100), ('--min-accuracy', 0.95),
                ('--workers', 1), ('--collective-timeout', 60.0), ('--startup-timeout', 120.0))
    for option, default in defaults:
        # The option's own help (up to the next option) ends with its default.
        section = text.split(' %s ' % option, 1)[1].split(' --', 1)[0]
        assert section.endswith('(default: %s)' % default), (option, section)
