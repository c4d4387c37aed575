"""What identifies one synchronized all-reduce: :class:`SyncKey`, stable hashes, group labels.

Every member of a group derives the same keys from names alone (layer
scopes, directions, the group's tower indices), never from counters that
differ between towers or processes; the backends turn them
into each backend's keys and shared names.
:mod:`tf1_syncbn.backends` re-exports :class:`SyncKey` and :func:`stable_hash`.
"""

import collections
import hashlib

__all__ = ['SyncKey', 'stable_hash', 'group_label']


SyncKey = collections.namedtuple('SyncKey', ['name', 'layer', 'group_size', 'device',
                                             'members', 'group'], defaults=(None, None))
SyncKey.__doc__ = """What identifies one synchronized all-reduce.

Attributes:
  name: the name shared by every member: the layer's scope with tower prefixes
    stripped, plus the per-tower call index (``'block1/BatchNorm:0'``).
  layer: the layer's full scope in this tower, for error messages.
  group_size: the number of members.
  device: the canonical device string of this member's forward op.
  members: the global tower indices of this member's sync group (worker
    ``w``'s tower ``t`` is ``w * towers + t``), a sorted tuple; None when the
    group is every tower of every worker (no ``group_size``). Backends key
    each group's collectives apart (:func:`group_label`).
  group: the index of that sync group among the groups (None with ``members``).
"""


def group_label(key):
    """``''`` for a key of every tower, else ``'/group<members>'``: the group's part of its keys.

    Members rather than the group index, so that explicit groups that share
    nothing never share a key.
    """
    if key.members is None:
        return ''
    return '/group' + ','.join(str(m) for m in key.members)


def stable_hash(text, bits=31):
    """A hash of ``text`` that is the same in every process (unlike ``hash()``).

    Returns:
      An int in ``[1, 2**bits - 1]`` (never 0, which TF reserves).
    """
    digest = hashlib.sha256(text.encode('utf-8')).digest()
    value = int.from_bytes(digest[:8], 'big') % ((1 << bits) - 1)
    return value + 1
