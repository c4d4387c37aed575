"""What identifies one synchronized all-reduce: :class:`SyncKey`, stable hashes, group labels.

Every member of a group derives the same keys from names alone (layer
scopes, directions, the group's tower indices), never from counters that
differ between towers or processes; the backends turn them
into each backend's keys and shared names.
:mod:`tf1_syncbn.backends` re-exports :class:`SyncKey` and :func:`stable_hash`.
"""

import collections
import hashlib
import inspect
import warnings

__all__ = ['SyncKey', 'stable_hash', 'group_label']

#: What a member count was called before it was ``num_members`` (deprecated, still read).
_OLD_COUNT = 'group_size'


def deprecated_count(owner, stacklevel=3):
    """Warns that ``owner``'s ``group_size`` is now ``num_members`` (a ``DeprecationWarning``)."""
    warnings.warn('%s: group_size (the number of all-reduce members) is now num_members; the old '
                  'name still works, and will go in a later release. (The layers\' group_size, '
                  'the user\'s sync groups, keeps its name.)' % owner, DeprecationWarning,
                  stacklevel=stacklevel)


#: The fields of :class:`SyncKey`, in their order (the third was ``group_size``).
SyncKeyFields = collections.namedtuple('SyncKeyFields', ['name', 'layer', 'num_members', 'device',
                                                         'members', 'group'],
                                       defaults=(None, None))


class SyncKey(SyncKeyFields):
    """What identifies one synchronized all-reduce.

    Attributes:
      name: the name shared by every member: the layer's scope with tower prefixes
        stripped, plus the per-tower call index (``'block1/BatchNorm:0'``).
      layer: the layer's full scope in this tower, for error messages.
      num_members: the number of members of the all-reduce (its size; which
        towers they are is ``members``).
      device: the canonical device string of this member's forward op.
      members: the global tower indices of this member's sync group (worker
        ``w``'s tower ``t`` is ``w * towers + t``), a sorted tuple; None when the
        group is every tower of every worker (no ``group_size``). Backends key
        each group's collectives apart (:func:`group_label`).
      group: the index of that sync group among the groups (None with ``members``).

    Deprecated: ``group_size``, the old name of ``num_members``, still works
    (``key.group_size``, ``SyncKey(..., group_size=n)``,
    ``key._replace(group_size=n)``) and warns with a ``DeprecationWarning``;
    the third field keeps its position.
    """

    __slots__ = ()
    # SyncKey(name, layer, num_members, device, members=None, group=None), as the fields say.
    __signature__ = inspect.signature(SyncKeyFields)

    def __new__(cls, *args, **kwargs):
        if _OLD_COUNT in kwargs:
            deprecated_count('SyncKey(%s=...)' % _OLD_COUNT)
            kwargs['num_members'] = kwargs.pop(_OLD_COUNT)
        return super().__new__(cls, *args, **kwargs)

    @property
    def group_size(self):
        """Deprecated: :attr:`num_members`."""
        deprecated_count('SyncKey.%s' % _OLD_COUNT)
        return self.num_members

    def _replace(self, **kwargs):
        if _OLD_COUNT in kwargs:
            deprecated_count('SyncKey._replace(%s=...)' % _OLD_COUNT)
            kwargs['num_members'] = kwargs.pop(_OLD_COUNT)
        return super()._replace(**kwargs)


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
