"""The command lines' parsers, their ``--help``, and the runner's start, before TensorFlow loads.

``python -m tf1_syncbn.<command>`` imports the package first, and the
package imports TensorFlow (20 to 30 s on a small machine) before the
command's module runs. :func:`answer_help_early`, called first thing by the
package, answers ``-h`` / ``--help`` of the package's commands (``audit``,
``selftest``, ``kernels``, ``launch``, ``run``) from the command line the
interpreter was started with (``sys.orig_argv``), with the command's own
parser: it prints the help and exits, as the command would, before anything
heavy is imported. :func:`start_early`, called next, starts ``python -m
tf1_syncbn.run``'s script in a new interpreter image, so that TensorFlow is
first imported by the script itself. Any other start goes on as usual. This
module imports only the standard library (``launch`` and ``run.startup``,
whose parsers it loads by name, import nothing more).
"""

import argparse
import importlib
import sys

__all__ = ['answer_help_early', 'start_early', 'audit_parser', 'selftest_parser',
           'kernels_parser', 'SELFTEST_BACKENDS']

#: The backends ``python -m tf1_syncbn.selftest`` checks.
SELFTEST_BACKENDS = ('collective', 'nccl', 'auto')
#: Interpreter options that take a value in the next argument.
_VALUE_OPTIONS = ('-W', '-X', '--check-hash-based-pycs')


def audit_parser():
    """``python -m tf1_syncbn.audit``'s parser."""
    parser = argparse.ArgumentParser(
        prog='python -m tf1_syncbn.audit',
        description='Audits the batch-norm layers of an exported training graph (MetaGraphDef): '
                    'towers, synchronization, moving-average updates. Exits 1 on problems.')
    parser.add_argument('meta_graph', help='a .meta file (tf.compat.v1.train.export_meta_graph)')
    parser.add_argument('--train-op', action='append', metavar='NAME',
                        help='the op one training step runs (repeat for several fetched ops, '
                             'e.g. the update ops); default: the graph\'s train_op collection')
    parser.add_argument('--tower-pattern', action='append', metavar='REGEX',
                        help='another tower name-scope convention, e.g. "gpu([0-9]+)"')
    return parser


def selftest_parser():
    """``python -m tf1_syncbn.selftest``'s parser."""
    parser = argparse.ArgumentParser(
        prog='python -m tf1_syncbn.selftest',
        description='Checks that N synchronized sync_batch_norm towers equal one device '
                    'running fused batch norm on the concatenated batch.')
    parser.add_argument('--towers', type=int, default=None,
                        help='number of towers (default: the number of GPUs when there are '
                             'at least 2, else 4 virtual CPUs)')
    parser.add_argument('--backend', choices=SELFTEST_BACKENDS + ('all',), default='all',
                        help='backend to check (default: all; nccl is skipped without GPUs)')
    parser.add_argument('--device', choices=('auto', 'cpu', 'gpu'), default='auto',
                        help='tower devices (default: GPUs when there is one per tower)')
    parser.add_argument('--steps', type=int, default=10,
                        help='timed training steps per backend (default 10)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--group-size', type=int, default=None, metavar='G',
                        help='synchronize within groups of G consecutive towers (the layers\' '
                             'group_size; each group against fused batch norm on its own '
                             'batch; default: one group of every tower)')
    parser.add_argument('--tf1-behavior', action='store_true',
                        help='check under tf.compat.v1.disable_v2_behavior() (TF1 behaviour: '
                             'reference variables, v1 control flow), as TF1 scripts run; '
                             'default: TF2-behaviour graph mode')
    return parser


def kernels_parser():
    """``python -m tf1_syncbn.kernels``' parser."""
    parser = argparse.ArgumentParser(
        prog='python -m tf1_syncbn.kernels',
        description='Compile the CPU kernels into the cache ahead of time.')
    parser.add_argument('--force', action='store_true', help='compile even when cached')
    return parser


def _launch_parser():
    return importlib.import_module('tf1_syncbn.launch').build_parser()


#: The runner's start (the standard library only: tf1_syncbn/run/startup.py).
_RUNNER = 'tf1_syncbn.run.startup'


def _run_parser():
    return importlib.import_module(_RUNNER).build_parser()


_PARSERS = {
    'tf1_syncbn.audit': audit_parser,
    'tf1_syncbn.selftest': selftest_parser,
    'tf1_syncbn.kernels': kernels_parser,
    'tf1_syncbn.launch': _launch_parser,
    'tf1_syncbn.run': _run_parser,
}


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
    build = _PARSERS.get(module)
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
        importlib.import_module(_RUNNER).exec_runner(args)
