"""The table of backends: ``sync_statistics`` to a backend (:func:`resolve`), op types to one.

Every backend in :data:`BACKENDS` declares the op types it builds
(:attr:`~tf1_syncbn.backends.base.SyncBackend.op_types`); the gradients, the
audit and the export read them here, so that a new backend is one class in
one module plus one entry below.
"""

from tf1_syncbn.backends.base import SyncBackend, device_type, gpus_present
from tf1_syncbn.backends.collective import CollectiveBackend
from tf1_syncbn.backends.horovod import HorovodBackend
from tf1_syncbn.backends.nccl import NcclBackend

__all__ = ['BACKENDS', 'VALID_NAMES', 'resolve', 'all_op_types', 'all_op_type_prefixes',
           'backend_of_op_type']


#: The backends, by the name that selects them in ``sync_statistics``.
BACKENDS = {
    'collective': CollectiveBackend,
    'nccl': NcclBackend,
    'horovod': HorovodBackend,
}
_BY_NAME = BACKENDS

VALID_NAMES = (None, 'auto') + tuple(_BY_NAME)


def resolve(spec, layer, device, towers, workers=1):
    """Turns a ``sync_statistics`` value into a backend object or None.

    Args:
      spec: None, a backend name, ``'auto'`` or a :class:`SyncBackend`.
      layer: the layer's name, for messages.
      device: this tower's canonical device string.
      towers: the number of members of the group, over every worker.
      workers: the number of worker processes the group spans (a
        ``tf.distribute`` multi-worker strategy; 1 elsewhere).

    Returns:
      A :class:`SyncBackend`, or None for per-tower statistics.

    ``'auto'`` picks None for a single member; across workers, collective
    ops (with the NCCL implementation on GPUs); within one process, ``'nccl'``
    when this tower is on a GPU *and* this process sees a physical GPU, and
    ``'collective'`` otherwise.
    """
    if spec is None or isinstance(spec, SyncBackend):
        return spec
    if not isinstance(spec, str):
        raise TypeError('%s: sync_statistics must be None, a string or a SyncBackend, got %r.'
                        % (layer, spec))
    name = spec.lower()
    on_gpu = device_type(device) == 'GPU' and gpus_present()
    if name == 'auto':
        if towers <= 1:
            return None
        if workers > 1:
            return CollectiveBackend(num_workers=workers,
                                     communication_hint='nccl' if on_gpu else 'auto')
        name = 'nccl' if on_gpu else 'collective'
    if name not in _BY_NAME:
        raise ValueError('%s: unknown sync_statistics=%r; use one of %s or a SyncBackend '
                         'object.' % (layer, spec, ', '.join(repr(v) for v in VALID_NAMES)))
    if name == 'collective':
        return CollectiveBackend(num_workers=workers)
    return _BY_NAME[name]()


def all_op_types():
    """Every op type a backend's all-reduce is built of (a frozenset)."""
    return frozenset().union(*(backend.op_types for backend in BACKENDS.values()))


def all_op_type_prefixes():
    """What the op types of every backend's communication library start with (a tuple)."""
    return tuple(backend.op_type_prefix for backend in BACKENDS.values()
                 if backend.op_type_prefix)


def backend_of_op_type(op_type):
    """The backend class whose all-reduce builds ops of ``op_type``, or None."""
    for backend in BACKENDS.values():
        if op_type in backend.op_types:
            return backend
    return None
