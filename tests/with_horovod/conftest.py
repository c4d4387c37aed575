"""The Horovod backend run for real: ``horovodrun --gloo``, 2 or 4 processes (make test-horovod).

These tests need Horovod built against the installed TensorFlow (``make
horovod``, ``tools/build_horovod.sh``). ``make test`` never collects this
directory (``make test-horovod`` runs it); a bare ``pytest`` collects it only
where Horovod is usable, and otherwise its summary says why. Named on the
command line (``make test-horovod``, ``pytest tests/with_horovod``) without
Horovod, every test fails with the reason, never skips.
"""

import importlib.util
import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def horovod_missing():
    """Why Horovod's TensorFlow ops cannot run here, or None.

    Checked without importing ``horovod.tensorflow`` into the test process
    (it imports Keras): the package and its compiled TensorFlow library must
    be installed, and ``horovodrun`` beside this interpreter. Whether the
    library loads is what the workers, and ``test_horovod_build``, show.
    """
    spec = importlib.util.find_spec('horovod')
    if spec is None or not spec.submodule_search_locations:
        return 'the horovod package is not installed'
    package = pathlib.Path(list(spec.submodule_search_locations)[0])
    if not list((package / 'tensorflow').glob('mpi_lib*.so')):
        return ('horovod is installed without its TensorFlow library '
                '(horovod/tensorflow/mpi_lib*.so)')
    from .horovod_run import HOROVODRUN  # noqa: PLC0415
    if not os.path.exists(HOROVODRUN):
        return '%s does not exist' % HOROVODRUN
    return None


_MISSING = horovod_missing()
_NOTE = ('tests/with_horovod: not collected: Horovod is not usable here (%s). '
         '`make test-horovod` builds it (make horovod) and runs them.' % _MISSING)


def _named(config):
    """Whether this directory, or a file in it, was named on the command line."""
    for arg in config.args:
        path = pathlib.Path(str(arg).split('::')[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    if _MISSING is None or _named(config):
        return None
    return pathlib.Path(collection_path).resolve().parent == HERE or None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    del exitstatus
    if _MISSING is not None and not _named(config):
        terminalreporter.write_line(_NOTE)


@pytest.fixture(autouse=True)
def _horovod_required():
    if _MISSING is not None:
        pytest.fail('Horovod is not usable here (%s): run `make horovod` (or `make '
                    'test-horovod`, which builds it).' % _MISSING, pytrace=False)
