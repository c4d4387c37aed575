"""The matrix's options: what one cell asks of a layer beyond the baseline, and its data.

An option is one deviation from the baseline (4 towers of 2 examples each,
NHWC rank-4 float32 data of mean 1 and spread 2, ``training`` a Python
``True``, every tower in one group): sync groups, ghost batches, renorm, the
non-fused path, a 16-bit input, another layout, a large mean, uneven towers
with an empty one, a bool tensor ``training``, the user's ``num_dev`` left
out. The data of a cell depend on its option only, so every harness and
front-end of an option meets the same numbers, and the oracle computes
each option's references once.

Imports neither ``tf1_syncbn`` nor ``tower``: the oracle's subprocess (the
replaced libraries) reads it too.

To add an option: one :class:`Option` in :data:`OPTIONS` (its ``parameters``
name the front-end arguments it exercises, which the completeness test
reads), then what each front-end does with it (``front_ends.py``'s
``FrontEnd.kwargs`` / ``not_applicable``) and, if some cell refuses it,
the rule in ``matrix.expect``.
"""

import dataclasses

import numpy as np

#: Towers of every in-process harness (the groups below are over these).
TOWERS = 4
CHANNELS = 3
#: The momentum (decay) of every layer's moving averages: far from 1, so that one
#: step moves them visibly.
MOMENTUM = 0.6
EPSILON = 1e-3
#: renorm's clipping and momentum, for the front-ends that have them.
RENORM_CLIPPING = {'rmax': 1.5, 'rmin': 0.7, 'dmax': 0.4}
RENORM_MOMENTUM = 0.7
#: tensorpack's BatchRenorm's own two clipping arguments.
BATCH_RENORM_RMAX, BATCH_RENORM_DMAX = 1.5, 0.4
#: Ghost batches: the global virtual batch (4 towers give one example each).
VIRTUAL_BATCH_SIZE = 4

#: Layouts: the global batch's shape (batch first) and the channel axis.
LAYOUTS = {
    'NHWC': ((8, 2, 2, CHANNELS), -1),
    'NCHW': ((8, CHANNELS, 2, 2), 1),
    'rank2': ((8, CHANNELS), -1),
}


@dataclasses.dataclass(frozen=True)
class Option:
    """One option value of the matrix (a column of the docs page's tables).

    Attributes:
      name: its id in test names and on the page.
      title: what it asks, for the page.
      parameters: the front-end arguments it exercises (the completeness
        test reads them, per front-end: ``front_ends.FrontEnd.parameters``).
      sizes: examples per tower (4 towers).
      layout: a key of :data:`LAYOUTS`.
      dtype: the input's type (the data are float32, cast by the cell).
      loc, scale: the data's mean and spread.
      group_size: the layer's ``group_size`` (None, an int, or a tuple of
        tuples of global tower indices).
      sync: ``'auto'``: the front-end synchronizes (tensorpack's layers are
        passed ``sync_statistics='auto'``, the others' default); ``None``:
        ``sync_statistics=None`` (tensorpack's default: passed nothing).
      feature: a layer feature: ``'renorm'``, ``'unfused'`` (``fused=False``)
        or ``'ghost'`` (``virtual_batch_size``).
      training_tensor: ``training`` / ``is_training`` is a bool placeholder
        (fed True).
      num_dev: the user passes ``num_dev`` where the harness names its
        towers by name scopes only (False: left out).
    """

    name: str
    title: str
    parameters: tuple = ()
    sizes: tuple = (2, 2, 2, 2)
    layout: str = 'NHWC'
    dtype: str = 'float32'
    loc: float = 1.0
    scale: float = 2.0
    group_size: object = None
    sync: object = 'auto'
    feature: object = None
    training_tensor: bool = False
    num_dev: bool = True

    @property
    def shape(self):
        """The global batch's shape."""
        return (sum(self.sizes),) + LAYOUTS[self.layout][0][1:]

    @property
    def channel_axis(self):
        return LAYOUTS[self.layout][1]

    @property
    def groups(self):
        """The sync groups as tuples of tower indices (one group: every tower)."""
        return resolve_groups(self.group_size, len(self.sizes))

    def oracle_groups(self):
        """The groups whose concatenated batches the replaced layer sees.

        ``sync_statistics=None`` asks for per-tower statistics: one group per tower.
        """
        if self.sync is None:
            return tuple((t,) for t in range(len(self.sizes)))
        return self.groups


def resolve_groups(group_size, towers):
    """``group_size`` (None, an int, or explicit groups) as a tuple of tuples of towers."""
    if group_size is None:
        return (tuple(range(towers)),)
    if isinstance(group_size, int):
        return tuple(tuple(range(start, start + group_size))
                     for start in range(0, towers, group_size))
    return tuple(tuple(group) for group in group_size)


OPTIONS = (
    Option('whole', 'the whole batch (no group_size)'),
    Option('uneven-empty', 'uneven towers of 3, 0, 4 and 1 examples', sizes=(3, 0, 4, 1)),
    Option('group_size=2', 'group_size=2: groups of two of the 4 towers',
           parameters=('group_size',), group_size=2),
    Option('groups=[[0,2,3],[1]]', 'explicit groups, uneven, one of one tower (not tower 0)',
           parameters=('group_size',), group_size=((0, 2, 3), (1,))),
    Option('groups=[[0],[1,2,3]]', "explicit groups: tower 0 alone (the moving statistics' "
           'group is one tower)', parameters=('group_size',), group_size=((0,), (1, 2, 3))),
    Option('sync=None', 'sync_statistics=None: per-tower statistics, asked for',
           parameters=('sync_statistics',), sync=None),
    Option('group_size+sync=None', 'group_size=2 with sync_statistics=None (nothing to '
           'group)', parameters=('group_size', 'sync_statistics'), group_size=2, sync=None),
    Option('ghost', 'ghost batches: a global virtual batch of 4 (one example per tower)',
           parameters=('virtual_batch_size',), feature='ghost'),
    Option('renorm', 'batch renormalization, clipped', feature='renorm',
           parameters=('renorm', 'renorm_clipping', 'renorm_decay', 'renorm_momentum')),
    Option('fused=False', 'the non-fused path', parameters=('fused',), feature='unfused'),
    Option('float16', 'float16 inputs', dtype='float16'),
    Option('bfloat16', 'bfloat16 inputs', dtype='bfloat16'),
    Option('NCHW', 'channels first (rank 4)', parameters=('data_format', 'axis', 'axes'),
           layout='NCHW'),
    Option('rank2', 'rank-2 inputs [batch, channels]', parameters=('axes',), layout='rank2'),
    Option('mean=1e4', 'data whose mean is 10^4 times its spread', loc=1e4, scale=1.0),
    Option('training=tensor', '`training` / `is_training` a bool tensor',
           parameters=('training', 'is_training'), training_tensor=True),
    Option('no num_dev', "the user's num_dev left out", parameters=('num_dev',), num_dev=False),
)
BY_NAME = {option.name: option for option in OPTIONS}
assert len(BY_NAME) == len(OPTIONS)


def option_data(option):
    """The option's data: float32 ``x``, ``dy`` and frequency ``weights`` of the global batch.

    Tower ``t`` holds rows ``tower_rows(option.sizes)[t]``; seeded by the
    option's name, so every cell of an option sees the same numbers.
    """
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(option.name)) % (2 ** 31)
    rng = np.random.RandomState(seed)
    shape = option.shape
    x = (rng.randn(*shape) * option.scale + option.loc).astype(np.float32)
    # Each tower's data differ (a shifted mean per tower), so that full sync,
    # per-tower statistics and the wrong group all give other numbers.
    rows = tower_rows(option.sizes)
    for t, r in enumerate(rows):
        x[r] += np.float32(option.scale * 0.7 * t)
    dy = rng.randn(*shape).astype(np.float32)
    weights = rng.randint(1, 4, shape[0]).astype(np.float32)   # frequency weights: copies
    return {'x': x, 'dy': dy, 'weights': weights}


def tower_rows(sizes):
    """The rows of the global batch that each tower holds: consecutive runs."""
    starts = np.cumsum([0] + list(sizes))
    return [np.arange(starts[i], starts[i + 1]) for i in range(len(sizes))]
