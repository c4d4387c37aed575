"""Starts tf1_syncbn's runner in a Python process whose environment sets ``TF1_SYNCBN_RUN``.

Imported by the start-up hook ``tf1_syncbn_run.pth``, which the package
installs at the top of ``site-packages`` (the convention coverage.py uses for
``COVERAGE_PROCESS_START``), only when ``TF1_SYNCBN_RUN`` is set and not
``0``: an unset variable costs one dictionary lookup, and imports nothing.

It loads ``tf1_syncbn/run/startup.py`` by its path and calls its
``install_from_environment()``: importing ``tf1_syncbn.run.startup`` by name
would import the package, which imports TensorFlow, and the script must
import TensorFlow itself, after setting its own environment. See
``docs/no-code-changes.md``.
"""

import importlib.util
import os
import sys

__all__ = ['start']

_STARTUP = 'tf1_syncbn.run.startup'


def start():
    """Installs the runner's start-up hook (idempotent).

    The process ends (status 2, the reason on stderr) when the package cannot
    be found, or the variable does not hold the runner's options: it does not
    run without the switch it was asked for. It ends at once (``os._exit``):
    an exception here, in the ``site`` module, would end it with a fatal error
    and the interpreter's traceback instead.
    """
    try:
        _start()
    except SystemExit as e:
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 2)


def _start():
    module = sys.modules.get(_STARTUP)
    if module is None:
        package = importlib.util.find_spec('tf1_syncbn')
        locations = list(getattr(package, 'submodule_search_locations', None) or ())
        path = os.path.join(locations[0], 'run', 'startup.py') if locations else None
        if path is None or not os.path.isfile(path):
            sys.stderr.write('TF1_SYNCBN_RUN is set, but tf1_syncbn\'s runner (tf1_syncbn/run/'
                             'startup.py) cannot be found on sys.path %s: reinstall the '
                             'package, or unset TF1_SYNCBN_RUN.\n' % sys.path)
            raise SystemExit(2)
        spec = importlib.util.spec_from_file_location(_STARTUP, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_STARTUP] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_STARTUP]
            raise
    module.install_from_environment()
