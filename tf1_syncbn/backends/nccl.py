"""The backend of NCCL between the GPUs of one process: :class:`NcclBackend`."""

import re

import tensorflow as tf

from tf1_syncbn.backends.base import SyncBackend, check_local_gpu, device_type
from tf1_syncbn.backends.keys import group_label

__all__ = ['NcclBackend']


class NcclBackend(SyncBackend):
    """``NcclAllReduce`` between the GPUs of one process.

    Shared names are the layer names with tower prefixes stripped. NCCL has no
    CPU kernel and no timeout: a tower that does not run the layer makes the
    others wait forever. Statistics are packed in float64 and gradients in
    float32, so bfloat16 inputs work although NCCL has no bfloat16 reduction.
    """

    name = 'nccl'
    op_types = frozenset(['NcclAllReduce'])
    num_members_attributes = {'NcclAllReduce': 'num_devices'}
    op_type_prefix = 'Nccl'

    def check(self, key):
        if key.num_members <= 1:
            return
        if device_type(key.device) != 'GPU':
            raise ValueError(
                "%s: sync_statistics='nccl' needs every tower on a GPU, but this tower is on "
                "%r (NCCL has no CPU kernel). Use sync_statistics='collective' instead."
                % (key.layer, key.device or 'no device'))
        check_local_gpu(key.layer, key.device, self.name)

    def shared_name(self, key, direction):
        return re.sub(r'[^A-Za-z0-9_./-]', '_', 'tf1_syncbn/%s/%s%s' % (key.name, direction,
                                                                         group_label(key)))

    def all_reduce(self, tensor, key, direction):
        from tensorflow.python.ops import gen_nccl_ops  # noqa: PLC0415 - NCCL backend only
        with tf.device(key.device):
            return gen_nccl_ops.nccl_all_reduce(
                input=tensor, reduction='sum', num_devices=key.num_members,
                shared_name=self.shared_name(key, direction))
