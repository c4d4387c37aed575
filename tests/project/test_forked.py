"""tests/support/forked.py runs a script as ``python script.py`` would, or says it failed.

The README's blocks (test_readme.py) pass or fail by what the zygote
reports, so the zygote must report what a fresh interpreter would: the exit
status of ``sys.exit``, an exception's status and traceback, a script that
outlives its timeout, the script's own arguments, folder and environment, and
a tf1_syncbn imported for the first time in the child.
"""

import concurrent.futures
import json
import os

import pytest

import forked

pytestmark = pytest.mark.once     # the helper, whatever the TF behaviour

SCRIPTS = {
    'reports.py': '''
import json, os, sys
fresh = 'tf1_syncbn' not in sys.modules
import tensorflow as tf
import tf1_syncbn
print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'name': __name__,
                  'variable': os.environ.get('FORKED_TEST_VARIABLE'),
                  'dropped': os.environ.get('FORKED_TEST_DROPPED'),
                  'path0': sys.path[0], 'fresh': fresh,
                  'eager': tf.executing_eagerly()}))
''',
    'exits.py': 'import sys\nsys.exit(3)\n',
    'raises.py': 'raise KeyError("the block failed")\n',
    'sleeps.py': 'import time\ntime.sleep(60)\n',
    'naps.py': 'import time\ntime.sleep(3)\n',
}


@pytest.fixture(scope='module')
def zygote():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', FORKED_TEST_DROPPED='the zygote\'s')
    zygote = forked.Zygote(env)
    yield zygote
    zygote.close()


@pytest.fixture
def folder(tmp_path):
    for name, text in SCRIPTS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != 'FORKED_TEST_DROPPED'}
    env.update(extra)
    return env


def test_a_script_sees_its_arguments_folder_and_environment(zygote, folder):
    status, stdout, stderr = zygote.run(['reports.py', 'one', 'two'], folder,
                                        _env(FORKED_TEST_VARIABLE='set'), timeout=120)
    assert status == 0, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == {'argv': ['reports.py', 'one', 'two'], 'cwd': str(folder),
                      'name': '__main__', 'variable': 'set', 'dropped': None,
                      'path0': str(folder), 'fresh': True, 'eager': True}


def test_exit_statuses_and_tracebacks_are_reported(zygote, folder):
    assert zygote.run(['exits.py'], folder, _env(), timeout=60) == (3, '', '')
    status, stdout, stderr = zygote.run(['raises.py'], folder, _env(), timeout=60)
    assert status == 1 and stdout == '' and "KeyError: 'the block failed'" in stderr, stderr


def test_a_script_past_its_timeout_is_killed_and_the_zygote_goes_on(zygote, folder):
    assert zygote.run(['sleeps.py'], folder, _env(), timeout=1) == (-9, '', '')
    assert zygote.run(['exits.py'], folder, _env(), timeout=60)[0] == 3


def test_scripts_run_from_two_threads_at_once_each_get_their_own_status(folder):
    """(test_layers_tf_keras_own_tests runs its two references from a thread pool.)"""
    env = _env()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(forked.run_python, [name], folder, env, 60)
                for name in ('naps.py', 'exits.py', 'raises.py')]
        assert [run.result()[0] for run in runs] == [0, 3, 1]
