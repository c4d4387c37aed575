"""Runs the unchanged scripts: under the runner, and under plain python (reference and control).

* :func:`plain_runs`: one process with legacy Keras (``legacy_reference.run_reference``: the
  replaced libraries themselves, tf-slim's ``batch_norm`` and tensorpack's ``BatchNorm``
  included) runs the script twice as ``python script.py`` would: on one device with the whole
  batch (the **reference**), then on ``towers`` towers (the **control**, what plain python
  gives there: per-tower statistics);
* :func:`under_runner`: the script under ``python -m tf1_syncbn.run`` (what that command
  ``exec``s: ``python tf1_syncbn/run/startup.py script.py args`` with ``TF1_SYNCBN_RUN``),
  forked from an interpreter that has imported TensorFlow (``forked.run_python``).

Each script takes ``TOWERS OUT.npz`` and writes its variables after training to ``OUT.npz``.
"""

import os
import shutil

import numpy as np

import forked
import support_paths
from legacy_reference import run_reference

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
#: What ``python -m tf1_syncbn.run`` becomes (tf1_syncbn.run.startup.exec_runner).
STARTUP = os.path.join(ROOT, 'tf1_syncbn', 'run', 'startup.py')
#: The environment of the scripts that need tf-keras as ``tf.keras`` (run_reference's).
LEGACY = {'TF_USE_LEGACY_KERAS': '1', 'TF_CPP_MIN_LOG_LEVEL': '3',
          'PYTHONPATH': support_paths.pythonpath()}

#: Runs the script twice, as ``python script.py`` would each time, in one process.
_TWICE = '''
import runpy, sys
import tensorflow as tf
script, towers, out = sys.argv[1:4]
for n, name in (('1', 'reference'), (towers, 'control')):
    tf.compat.v1.reset_default_graph()
    sys.argv = [script, n, '%s/%s.npz' % (out, name)]
    runpy.run_path(script, run_name='__main__')
'''


def script(name):
    return os.path.join(HERE, name)


def plain_runs(name, tmp_path, towers, timeout=300):
    """``(reference, control)``: the script's variables under plain python (see the module)."""
    out = tmp_path / ('plain_' + name[:-3])
    out.mkdir()
    run_reference(_TWICE, out, args=[script(name), str(towers), str(out)], timeout=timeout)
    return dict(np.load(out / 'reference.npz')), dict(np.load(out / 'control.npz'))


def under_runner(name, tmp_path, towers, options='1', legacy=False, timeout=300, env=None):
    """``(status, stdout, stderr, variables or None)`` of the script under the runner.

    Args:
      options: ``TF1_SYNCBN_RUN``'s value (the runner's options).
      legacy: in :data:`LEGACY`'s environment (tf-keras as ``tf.keras``), else the test's.
      env: more environment variables.
    """
    out = tmp_path / ('run_%s_%d.npz' % (name[:-3], towers))
    environ = dict(os.environ, **(LEGACY if legacy else {}))
    environ.update(env or {})
    environ['TF1_SYNCBN_RUN'] = options
    status, stdout, stderr = forked.run_python([STARTUP, script(name), str(towers), str(out)],
                                               tmp_path, environ, timeout)
    variables = dict(np.load(out)) if status == 0 and out.exists() else None
    return status, stdout, stderr, variables


def assert_same(ours, reference, rtol=2e-5, atol=2e-6):
    """Every variable of the reference, equal (the moving statistics included)."""
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=rtol, atol=atol, err_msg=name)


def differs(ours, reference):
    """Whether some variable differs from the reference beyond float rounding."""
    return any(not np.allclose(ours[name], value, rtol=1e-3, atol=1e-4)
               for name, value in reference.items())


def site_with_hook(tmp_path, paths=(ROOT,)):
    """``PYTHONPATH`` for processes that start as where the package is installed.

    A ``sitecustomize`` module processes a copy of ``tf1_syncbn_run.pth`` as ``site`` processes
    those of ``site-packages`` (this tree is not installed); ``paths`` follow it.
    """
    site_dir, custom = tmp_path / 'site-packages', tmp_path / 'sitecustomize'
    site_dir.mkdir(exist_ok=True)
    custom.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, 'tf1_syncbn_run.pth'), str(site_dir))
    (custom / 'sitecustomize.py').write_text('import site\nsite.addsitedir(%r)\n' % str(site_dir))
    return os.pathsep.join([str(custom)] + list(paths))
