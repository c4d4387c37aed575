"""The runner before TensorFlow loads: its options, its start-up hook, and the script it runs.

``python -m tf1_syncbn.run [options] script.py [args...]`` (or ``-m module``)
and ``TF1_SYNCBN_RUN='[options]' python script.py`` both end here. This
module imports only the standard library and nothing of the package, so that
it can run before TensorFlow is imported (the package imports TensorFlow):

* :func:`exec_runner`: ``python -m tf1_syncbn.run ...`` replaces its process
  (``os.execve``, before the package imports TensorFlow) with ``python
  <this file> script.py args...``, its options in ``TF1_SYNCBN_RUN``; the
  subprocesses the script starts inherit the variable;
* :func:`install`: the start-up hook. It watches the imports of TensorFlow and
  of the libraries whose batch norm the package replaces. Once TensorFlow
  (and the package's own imports: ``tf1_syncbn``, ``tower``, ``tf_slim``) are
  fully imported, it hands over to :mod:`tf1_syncbn.run.switches`, which
  switches every batch-norm API and installs the proof before the first
  training step (:mod:`tf1_syncbn.run.proof`); tensorpack and Keras 2 are
  switched when they are imported. The script's own imports, in its own
  order, thus get the library's layers, and whatever the script sets in
  ``os.environ`` before ``import tensorflow`` is seen by TensorFlow as
  without the runner;
* :func:`run_command`: runs the script as ``python script.py args`` would:
  ``sys.argv``, ``__main__``, ``sys.path[0]``, the exit status, and the
  traceback without the runner's frames.

Where the package is installed, a ``.pth`` start-up hook (``tf1_syncbn_run.pth``
and ``_tf1_syncbn_run.py`` at the top of ``site-packages``, the convention
coverage.py uses for ``COVERAGE_PROCESS_START``) loads this file by its path in
every Python process whose environment sets ``TF1_SYNCBN_RUN``, and calls
:func:`install_from_environment`. When the variable is unset, empty or
``0``, the ``.pth`` line reads it and does nothing else: no import at all.

This file is loaded three ways (as ``tf1_syncbn.run.startup``, by path from
the ``.pth`` hook, as the script ``python startup.py``); each registers the
module as ``tf1_syncbn.run.startup`` in ``sys.modules`` first, so that one
module, one hook and one set of options serve the process.
"""

import argparse
import os
import runpy
import shlex
import sys
import threading

__all__ = ['ENVIRONMENT_VARIABLE', 'STRICT_EXIT_STATUS', 'BACKENDS', 'build_parser',
           'parse_environment', 'options_text', 'exec_runner', 'install',
           'install_from_environment', 'run_command', 'main']

#: The environment variable that holds the runner's options (``1``: the defaults).
ENVIRONMENT_VARIABLE = 'TF1_SYNCBN_RUN'
#: The exit status of a run that ``--strict`` stops before its first training step.
STRICT_EXIT_STATUS = 3
#: ``--backend``: the layers' ``sync_statistics`` (``none``: per-tower statistics).
BACKENDS = ('auto', 'collective', 'nccl', 'horovod', 'none')
#: The library's own timeout variable (tf1_syncbn.timeouts), which ``--timeout`` sets.
TIMEOUT_VARIABLE = 'TF1_SYNCBN_TIMEOUT'
#: Values of ``TF1_SYNCBN_RUN`` that leave the runner off (the ``.pth`` line reads the same).
OFF = ('', '0')
#: Values that turn it on with the defaults.
DEFAULTS = ('1', 'true', 'yes', 'on')

_NAME = 'tf1_syncbn.run.startup'
#: The imports the hook watches: TensorFlow, what the package imports itself, and the
#: libraries whose batch norm it switches when they are imported.
WATCHED = ('tensorflow', 'tf1_syncbn', 'tower', 'tf_slim', 'tensorpack', 'tf_keras', 'keras')
#: What importing the package imports: it is switched on only when none of them is half-imported.
_PACKAGE_IMPORTS = ('tensorflow', 'tf1_syncbn', 'tower', 'tf_slim')


#: The runner's options, in their order: ``(flag, add_argument's keywords)``. The one list
#: of them: :func:`build_parser` adds them, ``TF1_SYNCBN_RUN``'s usage names them, and
#: :func:`options_text` writes parsed options back with them.
OPTIONS = (
    ('--num-dev', dict(type=int, metavar='N',
                       help='the number of towers of a script whose towers are tower_<i> / '
                            'clone_<i> name scopes (not needed with tensorpack\'s trainers, '
                            'tf.distribute or tower.TowerContext)')),
    ('--group-size', dict(type=int, metavar='G',
                          help='synchronize within groups of G consecutive towers (default: '
                               'every tower)')),
    ('--backend', dict(choices=BACKENDS, default='auto', metavar='B',
                       help='the layers\' sync_statistics: auto (NCCL on GPUs, collective ops '
                            'on CPUs), collective, nccl, horovod, or none (the library\'s '
                            'layers with per-tower statistics); default: auto')),
    ('--timeout', dict(type=float, metavar='S',
                       help='a step whose all-reduce waits longer than S seconds fails '
                            'instead of hanging (sets %s; default 600)' % TIMEOUT_VARIABLE)),
    ('--strict', dict(action='store_true',
                      help='stop before the first training step (exit status %d) when a '
                           'batch norm is not synchronized or its updates would not run'
                           % STRICT_EXIT_STATUS)),
    ('--report', dict(metavar='PATH',
                      help='also write the audit as JSON to PATH ({worker} and {pid} are '
                           'replaced; several workers without {worker}: PATH.worker<i>)')),
)


def build_parser():
    """``python -m tf1_syncbn.run``'s parser (also for ``TF1_SYNCBN_RUN``, without a command)."""
    parser = argparse.ArgumentParser(
        prog='python -m tf1_syncbn.run',
        usage='%(prog)s [options] (script.py | -m module) [args ...]',
        description='Runs an unchanged TF1 script with every batch norm it builds (tf.layers, '
                    'tf-slim, tensorpack, Keras 2) switched to tf1_syncbn\'s synchronized '
                    'layers, and audits its graph before the first training step: a report on '
                    'stderr, and with --strict no step when a batch norm is not synchronized or '
                    'its moving statistics would not update. The same for every Python process '
                    'whose environment has %s=\'[options]\' (1: the defaults), with the package '
                    'installed.' % ENVIRONMENT_VARIABLE)
    for flag, keywords in OPTIONS:
        parser.add_argument(flag, **keywords)
    parser.add_argument('-m', dest='module', nargs=argparse.REMAINDER, metavar='module',
                        help='run a module as a script, as python -m does')
    parser.add_argument('command', nargs=argparse.REMAINDER, metavar='script.py [args ...]',
                        help='the script and its arguments, as for python')
    return parser


def _check(parser, options):
    for name in ('num_dev', 'group_size'):
        value = getattr(options, name)
        if value is not None and value < 1:
            parser.error('--%s must be at least 1' % name.replace('_', '-'))
    if options.timeout is not None and not options.timeout > 0:
        parser.error('--timeout must be positive')
    if options.report is not None:
        options.report = os.path.abspath(options.report)
    return options


def parse_command_line(argv):
    """``(options, command)`` of ``python -m tf1_syncbn.run``'s arguments.

    ``command`` is ``['script.py', args...]`` or ``['-m', 'module', args...]``.

    Raises:
      SystemExit: status 2, with argparse's message, on a wrong or missing argument.
    """
    parser = build_parser()
    options = _check(parser, parser.parse_args(argv))
    if options.module is not None:
        if not options.module:
            parser.error('argument -m: expected the module to run')
        command = ['-m'] + options.module
    else:
        command = options.command[1:] if options.command[:1] == ['--'] else options.command
    if not command:
        parser.error('give the script to run (or -m module)')
    return options, command


def parse_environment(text):
    """The options of ``TF1_SYNCBN_RUN=text``, or None when it leaves the runner off.

    Raises:
      SystemExit: status 2, naming the variable, when the text is not the
        runner's options (the process does not start without the switch it
        was asked for).
    """
    text = (text or '').strip()
    if text in OFF:
        return None
    parser = build_parser()
    parser.prog = '%s=%r' % (ENVIRONMENT_VARIABLE, text)
    parser.usage = "%s='%s' (or 1: the defaults)" % (ENVIRONMENT_VARIABLE, ' '.join(
        '[%s]' % ' '.join((flag, keywords['metavar']) if 'metavar' in keywords else (flag,))
        for flag, keywords in OPTIONS))
    try:
        words = [] if text.lower() in DEFAULTS else shlex.split(text)
    except ValueError as e:
        parser.error(str(e))
    options = _check(parser, parser.parse_args(words))
    if options.module is not None or options.command:
        parser.error('holds the runner\'s options only (1 for the defaults), not a command')
    return options


def options_text(options):
    """The command line of ``options`` (a parsed namespace), for ``TF1_SYNCBN_RUN``."""
    words = []
    for flag, keywords in OPTIONS:
        value = getattr(options, flag[2:].replace('-', '_'))
        if keywords.get('action') == 'store_true':
            words += [flag] if value else []
        elif value is not None and value != keywords.get('default'):
            words += [flag, str(value)]
    return ' '.join(shlex.quote(w) for w in words) or '1'


def _interpreter_flags():
    """The flags the interpreter was started with, before ``-m tf1_syncbn.run`` (3.10+)."""
    argv = list(getattr(sys, 'orig_argv', ()))
    if '-m' not in argv:
        return []
    return argv[1:argv.index('-m')]


def exec_runner(argv):
    """``python -m tf1_syncbn.run argv...``: becomes ``python <this file> script.py args``.

    The process is replaced (``os.execve``: same process id, signals and exit
    status), with the options in ``TF1_SYNCBN_RUN`` (and ``--timeout`` in
    ``TF1_SYNCBN_TIMEOUT``) and the interpreter's own flags (``-u``, ``-W``,
    ``-X``) kept. Called before the package imports TensorFlow.

    Raises:
      SystemExit: status 2 on a wrong command line.
    """
    options, command = parse_command_line(argv)
    env = dict(os.environ)
    env[ENVIRONMENT_VARIABLE] = options_text(options)
    if options.timeout is not None:
        env[TIMEOUT_VARIABLE] = repr(options.timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + _interpreter_flags() +
              [os.path.abspath(__file__)] + command, env)


# --------------------------------------------------------------------------- the hook


class _Watcher(object):
    """A ``sys.meta_path`` finder that finds nothing itself: it reports watched imports.

    For a name of :data:`WATCHED` it asks the finders after it and wraps the
    loader of their spec, so that :meth:`loaded` runs once the module's code
    has run (before the import statement binds any name from it).
    """

    def __init__(self, text):
        self.text = text
        self.loading = set()        # watched modules whose code runs now
        self.switches = None        # tf1_syncbn.run.switches, once switched on
        self.error = None           # what switching on raised (raised again by the import)
        self._finding = set()
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, 'find_spec'):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, 'exec_module'):
            spec.loader = _Loader(spec.loader, fullname, self)
        return spec

    def ready(self):
        """Whether TensorFlow and the package's own imports are all fully imported."""
        return 'tensorflow' in sys.modules and not self.loading.intersection(_PACKAGE_IMPORTS)

    def loaded(self, name):
        """A watched module (or, with None, the hook's install) finished importing.

        Raises:
          Whatever switching on raises (once: the import that triggered it
          fails with it, and the runner stays off), or a front-end's switch
          refuses (:func:`tf1_syncbn.run.switches.library_loaded`).
        """
        if getattr(self._busy, 'on', False) or self.error is not None:
            return              # the switches' own imports, or switching on failed
        self._busy.on = True
        try:
            if self.switches is None:
                if self.ready():
                    import importlib  # noqa: PLC0415 - only once TensorFlow is imported
                    try:
                        switches = importlib.import_module('tf1_syncbn.run.switches')
                        switches.activate(self.text, frozenset(self.loading))
                    except BaseException as e:
                        self.error = e
                        raise
                    self.switches = switches
            elif name is not None:
                self.switches.library_loaded(name, frozenset(self.loading))
        finally:
            self._busy.on = False


class _Loader(object):
    """``loader``, then :meth:`_Watcher.loaded` once the module's code has run.

    The module keeps its own loader afterwards (``__loader__``,
    ``__spec__.loader``); meanwhile every other attribute is the loader's.
    """

    def __init__(self, loader, name, watcher):
        self._loader = loader
        self._name = name
        self._watcher = watcher

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._watcher.loading.add(self._name)
        try:
            self._loader.exec_module(module)
        finally:
            self._watcher.loading.discard(self._name)
            spec = getattr(module, '__spec__', None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(module, '__loader__', None) is self:
                module.__loader__ = self._loader
        self._watcher.loaded(self._name)

    def __getattr__(self, name):
        return getattr(self._loader, name)


_WATCHER = []        # the process's one watcher, once installed


def _register():
    """This module as ``tf1_syncbn.run.startup`` (loaded by path or run as a script)."""
    this = sys.modules.get(__name__)
    return sys.modules.setdefault(_NAME, this) if this is not None else sys.modules[_NAME]


def install(text):
    """Installs the start-up hook with the options ``text`` (idempotent).

    Switches on at once when TensorFlow is already imported, else when it is.

    Returns:
      True when this call installed it, False when it was already installed.
    """
    module = _register()
    if module is not sys.modules.get(__name__):
        return module.install(text)
    if _WATCHER:
        return False
    watcher = _Watcher(text)
    _WATCHER.append(watcher)
    sys.meta_path.insert(0, watcher)
    import atexit  # noqa: PLC0415 - only where the runner is on
    atexit.register(_unseen_tensorflow)
    watcher.loaded(None)
    return True


def installed():
    """Whether the start-up hook is installed in this process."""
    module = sys.modules.get(_NAME)
    return bool(module is not None and module._WATCHER)  # noqa: SLF001 - the one module


def install_from_environment(environ=None):
    """:func:`install` with ``TF1_SYNCBN_RUN``'s options (the ``.pth`` hook calls this).

    Sets ``TF1_SYNCBN_TIMEOUT`` from ``--timeout`` first, so that the
    package reads it.

    Returns:
      Whether the runner is on (the variable is set, and not to ``0``).

    Raises:
      SystemExit: status 2 when the variable does not hold the runner's options.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ENVIRONMENT_VARIABLE, '')
    options = parse_environment(text)
    if options is None:
        return False
    if options.timeout is not None:
        environ[TIMEOUT_VARIABLE] = repr(options.timeout)
    install(text)
    return True


def _unseen_tensorflow():
    """At exit: says so when TensorFlow was imported without the hook seeing it (never silent)."""
    watcher = _WATCHER[0]
    if watcher.switches is None and watcher.error is None and 'tensorflow' in sys.modules:
        sys.stderr.write('tf1_syncbn.run: TensorFlow was imported, but not through the '
                         'runner\'s import hook (another sys.meta_path finder loaded it): '
                         'nothing was switched to tf1_syncbn\'s layers in this process.\n')


# --------------------------------------------------------------------------- the script


def _script_path(script):
    """``sys.path[0]`` for ``python script``: its folder (symbolic links resolved), or the
    folder or zip file itself that holds a ``__main__.py``."""
    if os.path.isdir(script) or not script.endswith('.py') and os.path.isfile(script) and \
            _is_zip(script):
        return os.path.abspath(script)
    return os.path.dirname(os.path.realpath(script))


def _is_zip(path):
    import zipfile  # noqa: PLC0415 - only for a script that is not a .py file
    return zipfile.is_zipfile(path)


def _own_frames(traceback):
    """``traceback`` from its first frame that is neither this file's nor runpy's."""
    ours = os.path.abspath(__file__)
    while traceback is not None and (
            traceback.tb_frame.f_globals.get('__name__') == 'runpy' or
            os.path.abspath(traceback.tb_frame.f_code.co_filename) == ours):
        traceback = traceback.tb_next
    return traceback


def run_command(command, before=None):
    """Runs ``['script.py', args...]`` or ``['-m', 'module', args...]`` as ``python`` would.

    ``sys.argv``, ``sys.path[0]`` (the script's folder, or the current folder
    for ``-m``) and ``__main__`` are the script's; ``before()``, when given,
    runs once they are. An exception that ends the
    script is printed by ``sys.excepthook`` without the runner's frames, and
    the process exits with status 1, as ``python script.py`` does; a
    ``SystemExit`` keeps its status; ``KeyboardInterrupt`` ends the process as
    Python ends it (by SIGINT).
    """
    try:
        if command[0] == '-m':
            sys.argv = [command[1]] + list(command[2:])
            sys.path[0] = os.getcwd()
            if before is not None:
                before()
            runpy.run_module(command[1], run_name='__main__', alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path[0] = _script_path(command[0])
            if before is not None:
                before()
            runpy.run_path(command[0], run_name='__main__')
    except SystemExit:
        raise
    except KeyboardInterrupt as e:
        raise e.with_traceback(_own_frames(e.__traceback__))
    except BaseException as e:  # noqa: BLE001 - printed as python prints it, then status 1
        trimmed = _own_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(trimmed), trimmed)
        raise SystemExit(1) from None


def _package_on_path():
    """Makes ``import tf1_syncbn`` find the package this file belongs to.

    ``python -m tf1_syncbn.run`` found it where that command line looks (the
    current folder first); the script's ``sys.path`` starts with the
    script's folder instead. Where it would find another copy, or none (a
    source checkout run as ``python -m`` from its root), the package's folder
    goes right after the script's.
    """
    import importlib.util  # noqa: PLC0415 - only for the command line
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = importlib.util.find_spec('tf1_syncbn')
    locations = [os.path.abspath(p) for p in
                 (getattr(found, 'submodule_search_locations', None) or ())]
    if package not in locations:
        sys.path.insert(1, os.path.dirname(package))


def main(argv=None):
    """``python <this file> script.py args...``: what ``python -m tf1_syncbn.run`` becomes.

    The options come from ``TF1_SYNCBN_RUN`` (:func:`exec_runner` sets it; the
    defaults when it is unset), and stay there for the subprocesses.
    """
    module = _register()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.stderr.write('usage: python -m tf1_syncbn.run [options] (script.py | -m module) '
                         '[args ...]\n')
        raise SystemExit(2)
    if parse_environment(os.environ.get(ENVIRONMENT_VARIABLE, '')) is None:
        os.environ[ENVIRONMENT_VARIABLE] = '1'
    module.install_from_environment()
    module.run_command(argv, before=_package_on_path)


if __name__ == '__main__':
    main()
