"""The package's commands' parsers, built from the standard library only.

``python -m tf1_syncbn.<command> --help`` is answered from these before the
package imports TensorFlow (:mod:`tf1_syncbn._cli.early`). The launcher's
and the runner's parsers live with their commands (``tf1_syncbn.launch`` and
``tf1_syncbn/run/startup.py``, which import only the standard library too,
since both also run without the package) and are loaded by name here.
"""

import argparse
import importlib

__all__ = ['audit_parser', 'selftest_parser', 'kernels_parser', 'SELFTEST_BACKENDS', 'PARSERS',
           'LAUNCHER', 'RUNNER']

#: The backends ``python -m tf1_syncbn.selftest`` checks.
SELFTEST_BACKENDS = ('collective', 'nccl', 'auto')


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


#: The launcher's command line (the standard library only: tf1_syncbn/launch/command.py).
LAUNCHER = 'tf1_syncbn.launch.command'
#: The runner's start (the standard library only: tf1_syncbn/run/startup.py).
RUNNER = 'tf1_syncbn.run.startup'


def _launch_parser():
    return importlib.import_module(LAUNCHER).build_parser()


def _run_parser():
    return importlib.import_module(RUNNER).build_parser()


#: ``{command module: a function that builds its parser}``.
PARSERS = {
    'tf1_syncbn.audit': audit_parser,
    'tf1_syncbn.selftest': selftest_parser,
    'tf1_syncbn.kernels': kernels_parser,
    'tf1_syncbn.launch': _launch_parser,
    'tf1_syncbn.run': _run_parser,
}
