"""``python -m tf1_syncbn.launch``'s command line: :func:`build_parser` and :func:`main`.

The standard library only: ``tf1_syncbn._cli`` builds the parser to answer
``--help`` before the package imports TensorFlow, and the launcher also runs
by its path, without the package (``python path/to/tf1_syncbn/launch``).
"""

import argparse
import os

if __package__:
    from tf1_syncbn.launch.launcher import (DEFAULT_GRACE, DEFAULT_KILL_AFTER, gpu_assignment,
                                            launch)
else:   # run by path (python path/to/tf1_syncbn/launch): the modules next to this file
    from launcher import DEFAULT_GRACE, DEFAULT_KILL_AFTER, gpu_assignment, launch

__all__ = ['build_parser', 'main']


def build_parser():
    """The command line's parser (also for its ``--help`` before the package loads)."""
    parser = argparse.ArgumentParser(
        prog='python -m tf1_syncbn.launch',
        description='Run a command as N local workers, each with its own TF_CONFIG; stop all '
                    'of them when one fails.')
    parser.add_argument('--workers', type=int, required=True, help='number of local workers')
    parser.add_argument('--grace', type=float, default=DEFAULT_GRACE,
                        help='seconds the others get to exit on their own after one fails')
    parser.add_argument('--kill-after', type=float, default=DEFAULT_KILL_AFTER,
                        help='seconds between SIGTERM and SIGKILL')
    parser.add_argument('--timeout', type=float,
                        help='stop every worker after this many s (restarts included)')
    parser.add_argument('--max-restarts', type=int, default=0, metavar='N',
                        help='when a worker fails, stop the others and start every worker '
                             'again, up to N times (they resume from the chief\'s latest '
                             'checkpoint)')
    parser.add_argument('--gpus-per-worker', type=int, metavar='K',
                        help='give worker i the GPUs i*K..i*K+K-1 (CUDA_VISIBLE_DEVICES; a '
                             'slice of the launcher\'s own CUDA_VISIBLE_DEVICES when set)')
    parser.add_argument('command', nargs=argparse.REMAINDER,
                        help='the worker command (after --)')
    return parser


def main(argv=None):
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Raises:
      SystemExit: status 2, with argparse's message, on a wrong or missing argument.

    Hangs: as long as the job runs (``--timeout`` bounds it).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        parser.error('give the worker command after --')
    if args.workers < 1:
        parser.error('--workers must be at least 1')
    if args.max_restarts < 0:
        parser.error('--max-restarts must be at least 0')
    if args.gpus_per_worker is not None:
        try:
            gpu_assignment(args.workers, args.gpus_per_worker,
                           os.environ.get('CUDA_VISIBLE_DEVICES'))
        except ValueError as e:
            parser.error(str(e).replace('Launcher: ', '').replace('gpus_per_worker',
                                                                 '--gpus-per-worker'))
    return launch(command, args.workers, timeout=args.timeout, max_restarts=args.max_restarts,
                  grace=args.grace, kill_after=args.kill_after,
                  gpus_per_worker=args.gpus_per_worker)
