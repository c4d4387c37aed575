"""A script in an interpreter of its own, in the run's TF behaviour and a Keras setting.

What a patch switches depends on what the process imported before it, and
which Keras ``tf.compat.v1.layers`` hands out on ``TF_USE_LEGACY_KERAS``:
the tests of the patches' names run their script with :func:`run`, as
``python -c`` (a fresh import of TensorFlow and Keras, not a fork of the
test process). The script is the body of :data:`PRELUDE` ... :data:`REPORT`:
it fills the dict ``out``, which :func:`run` returns.
"""

import json
import os
import subprocess
import sys

import support_paths
import tf_behavior

#: The Keras settings: ``TF_USE_LEGACY_KERAS`` unset (Keras 2.15 on TensorFlow
#: 2.15, Keras 3 from 2.16) and ``TF_USE_LEGACY_KERAS=1`` (tf-keras).
KERAS = {'default': {}, 'legacy': {'TF_USE_LEGACY_KERAS': '1'}}
#: The script's start: the run's TF behaviour, ``tf``, ``tf1``, ``json``, ``sys`` and ``out``.
PRELUDE = tf_behavior.SOURCE + '''
import json
import sys
import tensorflow as tf

tf1 = tf.compat.v1
out = {}
'''
#: The script's end: ``out`` on stdout, for :func:`run`.
REPORT = '''
print('RESULT ' + json.dumps(out))
'''


def run(body, keras, timeout):
    """Runs ``PRELUDE + body + REPORT`` in a fresh interpreter with Keras setting ``keras``.

    Args:
      body: the script's own lines.
      keras: a key of :data:`KERAS`.
      timeout: seconds the script may take.

    Returns:
      The script's ``out``.

    Raises:
      AssertionError: with the script's output, when it fails.
      subprocess.TimeoutExpired: when it outlives ``timeout``.
    """
    env = {k: v for k, v in os.environ.items() if k != 'TF_USE_LEGACY_KERAS'}
    env.update(KERAS[keras], TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=support_paths.pythonpath())
    done = subprocess.run([sys.executable, '-c', PRELUDE + body + REPORT], env=env,
                          cwd=support_paths.ROOT, text=True, capture_output=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    line = [l for l in done.stdout.splitlines() if l.startswith('RESULT ')][-1]
    return json.loads(line[len('RESULT '):])
