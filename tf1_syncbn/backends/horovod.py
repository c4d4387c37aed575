"""The backend of Horovod's all-reduce across processes: :class:`HorovodBackend`."""

import os
import re
import warnings

import tensorflow as tf

from tf1_syncbn.backends.base import SyncBackend
from tf1_syncbn.backends.collective import CollectiveBackend

__all__ = ['HorovodBackend', 'stall_shutdown_seconds']


class HorovodBackend(SyncBackend):
    """``horovod.tensorflow.allreduce`` across the processes of a Horovod job.

    The group is every tower of every Horovod process (``hvd.size()``
    processes, each building the same ``towers`` towers; one, Horovod's
    convention, when the layer is built outside any tower). Horovod matches
    an all-reduce across processes by the op's full name, tower scope
    included, so with several towers per process tower ``t`` would meet only
    tower ``t`` of the other processes. The towers of a process therefore
    first sum over themselves with a collective op on their devices (one
    ``CollectiveReduce`` each way, as :class:`CollectiveBackend` builds it;
    each tower on its own device), and each tower then all-reduces that local
    sum across processes: every tower gets the sum over all towers of all
    processes. One tower per process: one ``HorovodAllreduce`` each way.

    Hangs: Horovod has no timeout, and the step watchdog cannot abort its
    ops (:meth:`step_timeout` is 0). A process that never submits an
    all-reduce that the others wait in (a layer skipped at run time, update
    ops run without the forward pass, different graphs) leaves them waiting
    until Horovod's stall inspector shuts Horovod down, which it does only
    when ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` is set (``horovodrun
    --stall-check-shutdown-time-seconds``; at least
    ``HOROVOD_STALL_CHECK_TIME_SECONDS``, default 60): every pending op then
    fails, after about the check time plus the shutdown time. Unset (Horovod's
    default), it logs the missing ranks and op names every check time and
    waits forever; the backend warns about that once per process. A process
    that exits or dies ends the job under ``horovodrun``, which terminates
    the others. The local collective of several towers carries
    :data:`tf1_syncbn.timeouts.DEFAULT_TIMEOUT` per op.
    """

    name = 'horovod'
    # Its local sum over several towers of a process is CollectiveBackend's op.
    op_types = frozenset(['HorovodAllreduce', 'HorovodGroupedAllreduce'])
    op_type_prefix = 'Horovod'
    implicit_single_tower = True
    _warned_stall = False

    def __init__(self):
        try:
            import horovod.tensorflow as hvd  # noqa: PLC0415 - optional dependency
        except ImportError as e:
            raise ValueError("sync_statistics='horovod' needs horovod.tensorflow, which does "
                             "not import here (%s). Install horovod (make horovod) or choose "
                             "another backend." % e)
        self._hvd = hvd
        self._local = CollectiveBackend()
        if not HorovodBackend._warned_stall and not stall_shutdown_seconds():
            HorovodBackend._warned_stall = True
            warnings.warn(
                "sync_statistics='horovod': Horovod's stall shutdown is off, so a process "
                "that skips a synchronized layer leaves the others waiting forever (Horovod "
                "only logs the stall). Set HOROVOD_STALL_SHUTDOWN_TIME_SECONDS >= "
                "HOROVOD_STALL_CHECK_TIME_SECONDS (horovodrun "
                "--stall-check-shutdown-time-seconds) to turn it into an error.", UserWarning,
                stacklevel=2)

    def num_members(self, towers):
        return self._hvd.size() * towers

    def worker_rank(self):
        return self._hvd.rank()

    def check_groups(self, layer, groups, towers):
        """Raises ``ValueError`` for sync groups that span Horovod processes.

        Groups within one process are collectives among its towers (no
        Horovod op); groups across processes would need Horovod process sets,
        which must be registered when ``hvd.init`` runs, before the graph.
        """
        for members in groups:
            if len({m // towers for m in members}) > 1:
                raise ValueError(
                    "%s: sync_statistics='horovod' cannot synchronize the group of towers %s: "
                    'it spans Horovod processes (%d towers per process), and a group across '
                    'processes would need a Horovod process set, which hvd.init must register '
                    'before any graph is built. Use a group_size that divides the %d towers '
                    'of each process (each group is then a collective among its towers), '
                    'or run the workers with tf1_syncbn.distributed and CollectiveBackend, '
                    'whose groups may span workers.'
                    % (layer, list(members), towers, towers))

    def towers(self, key):
        """The number of towers per process in ``key``'s group."""
        return key.num_members // self._hvd.size()

    def check(self, key):
        if key.members is not None:
            self._local.check(key)
        elif self.towers(key) > 1:
            self._local.check(key._replace(num_members=self.towers(key)))

    def all_reduce_workers(self, tensor, key, direction):
        name = re.sub(r'[^A-Za-z0-9_.-]', '_', 'tf1_syncbn.%s.%s' % (key.name, direction))
        with tf.device(key.device):
            return self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name)

    def all_reduce(self, tensor, key, direction):
        if key.members is not None:     # a group within this process (check_groups)
            return self._local.all_reduce(tensor, key._replace(name='horovod/' + key.name),
                                          direction)
        towers = self.towers(key)
        if towers > 1:
            local = key._replace(name='horovod/' + key.name, num_members=towers)
            tensor = self._local.all_reduce(tensor, local, direction)
        name = re.sub(r'[^A-Za-z0-9_.-]', '_', 'tf1_syncbn.%s.%s' % (key.name, direction))
        with tf.device(key.device):
            return self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name)


def stall_shutdown_seconds(environ=None):
    """Seconds after which Horovod's stall inspector shuts a stalled job down (0: never).

    Read from the environment as Horovod reads it at ``hvd.init()`` (C
    ``strtol``): ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, 0 when unset, when
    ``HOROVOD_STALL_CHECK_DISABLE`` is a positive number, or when it is below
    ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (default 60), where Horovod ignores it.
    """
    environ = os.environ if environ is None else environ

    def number(name, default):
        if name not in environ:
            return default
        match = re.match(r'\s*([+-]?[0-9]+)', environ[name])
        return int(match.group(1)) if match else 0

    if number('HOROVOD_STALL_CHECK_DISABLE', 0) > 0:
        return 0
    shutdown = number('HOROVOD_STALL_SHUTDOWN_TIME_SECONDS', 0)
    return shutdown if shutdown > 0 and shutdown >= number('HOROVOD_STALL_CHECK_TIME_SECONDS',
                                                            60) else 0
