"""The runner under the launcher, in both forms: the environment variable
(``TF1_SYNCBN_RUN=... python -m tf1_syncbn.launch --workers 2 -- python script.py``) and the
command (``python -m tf1_syncbn.launch --workers 2 -- python -m tf1_syncbn.run ... script.py``).

Every worker the launcher starts is a new Python process; ``tf1_syncbn_run.pth`` (processed as
where the package is installed) switches it on in the first form, the runner's command in the
second. The unchanged ``tower_%d`` tf.layers script
runs 2 towers in each of 2 workers: each worker equals tf.layers itself on one device with the
concatenated batch, and writes its own report (``report.worker<i>.json``: the launcher's
``TF_CONFIG`` names 2 workers). The launcher runs as a plain script (it imports no TensorFlow).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import support_paths
from unchanged import harness

#: The launcher's process handling, whatever the TF behaviour: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

LAUNCH = os.path.join(harness.ROOT, 'tf1_syncbn', 'launch')


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    reference, control = harness.plain_runs('layers_towers.py',
                                            tmp_path_factory.mktemp('plain'), 2)
    assert harness.differs(control, reference)
    return reference


@pytest.mark.parametrize('form', ['variable', 'command'])
def test_the_runner_switches_every_worker_the_launcher_starts(reference, tmp_path, form):
    options = ['--num-dev', '2', '--report', str(tmp_path / 'report.json')]
    env = dict(os.environ, PYTHONPATH=harness.site_with_hook(tmp_path, support_paths.paths()),
               TF_CPP_MIN_LOG_LEVEL='3')
    env.pop('TF1_SYNCBN_RUN', None)
    if form == 'variable':
        env['TF1_SYNCBN_RUN'] = ' '.join(options)
        runner = []
    else:
        runner = ['-m', 'tf1_syncbn.run'] + options
    proc = subprocess.run(
        [sys.executable, LAUNCH, '--workers', '2', '--timeout', '400', '--', sys.executable] +
        runner + [harness.script('layers_towers.py'), '2', str(tmp_path / 'out.{worker}.npz')],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for worker in (0, 1):
        harness.assert_same(dict(np.load(tmp_path / ('out.%d.npz' % worker))), reference)
        report = json.loads((tmp_path / ('report.worker%d.json' % worker)).read_text())
        assert (report['worker'], report['workers'], report['ok']) == (worker, 2, True)
        layer, = report['graphs'][0]['audit']['layers']
        assert (layer['name'], layer['synchronized'], layer['group_size']) == ('bn', True, 2)
    assert proc.stdout.count('tf1_syncbn.run: OK') == 2, proc.stdout[-3000:]
