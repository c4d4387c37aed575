"""All-reduce backends for synchronized statistics: ``tf1_syncbn.backends``.

Each backend is one small object with the same two methods:

* ``num_members(towers)``: how many members the all-reduce has, given the
  number of towers built in this graph (``key.num_members``; which towers
  they are, with sync groups, is ``key.members``);
* ``all_reduce(tensor, key, direction)``: the element-wise sum of ``tensor``
  over every member, built on ``key.device``.

``key`` is a :class:`SyncKey`; ``direction`` is ``'forward'``, or
``'backward'`` for the first gradient built of the call and ``'backward/<k>'``
for the k-th after it (``tf1_syncbn._sync.plan.backward_direction``). Every member
of a group must build the same keys, in any order; names and keys are derived
from layer names and directions, never from counters that differ between
towers or processes.

The member count was called ``group_size`` before (``group_size(towers)``,
``key.group_size``, ``group_size_attributes``), a name the layers' own
``group_size`` (the user's sync groups) keeps: a backend written with the old
names still works, with a ``DeprecationWarning`` (see :class:`SyncBackend`).

Choose a backend with the ``sync_statistics`` argument of the layers: a string
(``'collective'``, ``'nccl'``, ``'horovod'``, ``'auto'``), None, or a backend
object such as ``CollectiveBackend(timeout=30)``.

One module per backend (:mod:`~tf1_syncbn.backends.collective`,
:mod:`~tf1_syncbn.backends.nccl`, :mod:`~tf1_syncbn.backends.horovod`), the
interface in :mod:`~tf1_syncbn.backends.base`, and the table that turns a
``sync_statistics`` string into one in :mod:`~tf1_syncbn.backends.resolve`; what names
one all-reduce (:class:`SyncKey`, the group label, stable hashes) in
:mod:`~tf1_syncbn.backends.keys`.
"""

# Besides __all__, the names the library's modules and tests reach here: the
# shared device helpers, the table of backends (resolve, VALID_NAMES, the op
# types), stall_shutdown_seconds(), group_label().
# ruff: noqa: F401
from tf1_syncbn.backends.base import (SyncBackend, check_local_gpu, device_type, gpus_present,
                                      local_gpu_count, physical_gpu_count)
from tf1_syncbn.backends.collective import CollectiveBackend
from tf1_syncbn.backends.keys import SyncKey, group_label, stable_hash
from tf1_syncbn.backends.horovod import HorovodBackend, stall_shutdown_seconds
from tf1_syncbn.backends.nccl import NcclBackend
from tf1_syncbn.backends.resolve import (BACKENDS, VALID_NAMES, all_op_type_prefixes, all_op_types,
                                         backend_of_op_type, resolve)
from tf1_syncbn.timeouts import DEFAULT_TIMEOUT, op_timeout

__all__ = ['SyncBackend', 'SyncKey', 'CollectiveBackend', 'NcclBackend', 'HorovodBackend',
           'stable_hash', 'DEFAULT_TIMEOUT', 'op_timeout']
