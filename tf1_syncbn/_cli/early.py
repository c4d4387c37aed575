"""Before TensorFlow loads: a command's ``--help``, and the runner's start.

``python -m tf1_syncbn.<command>`` imports the package first, and the
package imports TensorFlow (20 to 30 s on a small machine) before the
command's module runs. :func:`answer_help_early`, called first thing by the
package, answers ``-h`` / ``--help`` of the package's commands (``audit``,
``selftest``, ``kernels``, ``launch``, ``run``) from the command line the
interpreter was started with (``sys.orig_argv``), with the command's own
parser (:mod:`tf1_syncbn._cli.parsers`): it prints the help and exits, as the
command would, before anything heavy is imported. :func:`start_early`, called
next, starts ``python -m tf1_syncbn.run``'s script in a new interpreter image,
so that TensorFlow is first imported by the script itself. Any other start
goes on as usual. The standard library only.
"""

import importlib
import sys

from tf1_syncbn._cli.parsers import PARSERS, RUNNER

__all__ = ['answer_help_early', 'start_early']

#: Interpreter options that take a value in the next argument.
_VALUE_OPTIONS = ('-W', '-X', '--check-hash-based-pycs')


def _module_and_args(argv):
    """``(module, its arguments)`` of ``python [options] -m module args``, or ``(None, [])``."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == '-m':
            return (argv[i + 1], argv[i + 2:]) if i + 1 < len(argv) else (None, [])
        if not arg.startswith('-') or arg in ('-c', '-'):
            return None, []          # a script, code or stdin: not a command of ours
        i += 2 if arg in _VALUE_OPTIONS else 1
    return None, []


def answer_help_early(argv=None):
    """Prints a command's help and exits, when ``python -m tf1_syncbn.<command>`` asks for it.

    Args:
      argv: the interpreter's command line (default ``sys.orig_argv``).

    Returns:
      None, when the command line does not ask one of the package's commands
      for its help (the parser's help action exits the process otherwise).
    """
    argv = list(getattr(sys, 'orig_argv', ()) if argv is None else argv)
    module, args = _module_and_args(argv)
    build = PARSERS.get(module)
    if build is None or not any(a in ('-h', '--help') for a in args):
        return
    # The help action prints and exits when argparse reaches it; a '--help'
    # that is not ours (launch's worker command) leaves the parse to finish.
    build().parse_known_args(args)


def start_early(argv=None):
    """Starts ``python -m tf1_syncbn.run``'s script before the package imports TensorFlow.

    The process becomes ``python tf1_syncbn/run/startup.py script.py args``
    (:func:`tf1_syncbn.run.startup.exec_runner`: ``os.execve``), so that the
    script imports TensorFlow itself, in its own environment.

    Args:
      argv: the interpreter's command line (default ``sys.orig_argv``).

    Returns:
      None, when the command line is not ``python [flags] -m tf1_syncbn.run ...``
      (it does not return otherwise).
    """
    argv = list(getattr(sys, 'orig_argv', ()) if argv is None else argv)
    module, args = _module_and_args(argv)
    if module == 'tf1_syncbn.run':
        importlib.import_module(RUNNER).exec_runner(args)
