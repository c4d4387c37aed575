"""Runs reference libraries that only work with legacy Keras, in a subprocess.

tf-slim 1.1.0's ``batch_norm`` and tensorpack 0.11's ``BatchNorm`` need
``tf-keras`` and ``TF_USE_LEGACY_KERAS=1`` on TensorFlow 2.16+. They are test
references only: the library never imports them. Tests call
:func:`run_reference` with the path of a script; the script's stdout ends with
a line ``RESULT <path to .npz>``.
"""

import os

import forked
import support_paths

SHIM = '''
import importlib, sys
# TF 2.21 looks for tf_keras.legacy_tf_layers; tf-keras 2.21 ships it under src/.
import tf_keras.src.legacy_tf_layers as _legacy
sys.modules.setdefault('tf_keras.legacy_tf_layers', _legacy)
for _name in ('normalization', 'base', 'core', 'convolutional', 'pooling'):
    try:
        sys.modules.setdefault('tf_keras.legacy_tf_layers.' + _name,
                               importlib.import_module('tf_keras.src.legacy_tf_layers.' + _name))
    except ImportError:
        pass
# tf-slim 1.1's layers.utils.constant_value (used by its fused and non-fused
# batch_norm paths) reads ops.Tensor, which TF 2.21 moved to framework.tensor.
from tensorflow.python.framework import ops as _ops, tensor as _tensor
if not hasattr(_ops, 'Tensor'):
    _ops.Tensor = _tensor.Tensor
'''


def run_reference(code, tmp_path, args=(), timeout=300, env=None):
    """Runs ``code`` (after the legacy-Keras shim) as a fresh interpreter would.

    Forked from an interpreter that has imported TensorFlow with this
    environment (``forked.run_python``: one per test process; each run
    imports tf-keras, the replaced library and anything else itself, in its
    own process). ``env`` adds environment variables for the script.

    Returns:
      The stdout of the script.

    Raises:
      RuntimeError: with the script's output when it fails or outlives
        ``timeout`` seconds.
    """
    script = tmp_path / 'reference_script.py'
    script.write_text(SHIM + code)
    env = dict(os.environ, TF_USE_LEGACY_KERAS='1', TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=support_paths.pythonpath(),
               **(env or {}))
    status, stdout, stderr = forked.run_python([str(script)] + list(args), tmp_path, env,
                                               timeout)
    if status != 0:
        raise RuntimeError('reference script failed (exit status %d; needs tf-keras, installed '
                           'by make test):\n%s\n%s' % (status, stdout[-3000:], stderr[-5000:]))
    return stdout
