"""Errors of multi-worker training, and how a process leaves after one."""

import logging
import os
import sys

__all__ = ['ClusterError', 'PeerMissingError', 'WorkerLostError', 'hard_exit',
           'EXIT_STARTUP_HANG']

#: Exit status of a process whose session start-up stayed blocked (see the module docstring).
EXIT_STARTUP_HANG = 75


class ClusterError(RuntimeError):
    """A multi-worker failure: a peer missing at start-up or lost during training."""


class PeerMissingError(ClusterError):
    """A peer did not answer at start-up. ``missing`` lists ``'worker <i> (<address>)'``."""

    def __init__(self, message, missing=()):
        super().__init__(message)
        self.missing = list(missing)


class WorkerLostError(ClusterError):
    """A collective failed during training: a worker died, froze or was stopped."""


def hard_exit(code):
    """Flushes stdout/stderr and ends the process now with ``os._exit(code)``.

    Use it after a :class:`ClusterError`: TensorFlow's server cannot be
    stopped and its collective executor stays aborted, and a normal
    interpreter shutdown with a server whose peers are gone may block or crash.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed streams must not keep us alive
            pass
    logging.shutdown()
    os._exit(code)
