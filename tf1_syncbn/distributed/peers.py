"""Whether the other workers' servers answer: the start-up check and the lost-worker probe."""

import time
import socket

from tf1_syncbn.distributed.cluster import parse_address
from tf1_syncbn.distributed.errors import PeerMissingError

__all__ = ['unreachable_peers', 'wait_for_peers']


def _reachable(address, timeout=1.0):
    host, port = parse_address(address, 'address')
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def unreachable_peers(cluster, settle=0.0):
    """The peers (``Cluster.describe`` strings) whose server does not accept connections.

    Args:
      cluster: a :class:`Cluster`.
      settle: while every peer still answers, probe again for up to this many
        seconds (a killed process's port closes only when its exit completes).
    """
    deadline = time.time() + settle
    while True:
        missing = [cluster.describe(r) for r in range(len(cluster.addresses))
                   if r != cluster.rank and not _reachable(cluster.addresses[r])]
        if missing or time.time() >= deadline:
            return missing
        time.sleep(0.25)


def wait_for_peers(cluster, timeout=None):
    """Waits until every peer's server accepts connections.

    Args:
      cluster: a :class:`Cluster`.
      timeout: seconds; None uses ``cluster.startup_timeout``.

    Raises:
      PeerMissingError: naming every worker that did not answer in time.
    """
    if cluster.num_workers <= 1:
        return
    timeout = cluster.startup_timeout if timeout is None else timeout
    deadline = time.time() + timeout
    pending = [r for r in range(cluster.num_workers) if r != cluster.rank]
    while True:
        pending = [r for r in pending if not _reachable(cluster.addresses[r])]
        if not pending:
            return
        if time.time() >= deadline:
            missing = [cluster.describe(r) for r in pending]
            raise PeerMissingError(
                '%s: %s did not answer within the start-up timeout of %g s. Start every worker '
                '(same host list, each with its own task index), or raise startup_timeout.'
                % (cluster.describe(cluster.rank), ', '.join(missing), timeout), missing)
        time.sleep(0.2)
