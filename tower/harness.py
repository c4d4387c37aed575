"""How other training harnesses mark their towers: the one adapter place.

Layers that synchronize across towers must find their tower however the
user's script built it. Three kinds of harness are recognized here, and
nowhere else in the library:

* **Name-scope towers.** Scripts that build one copy of the model per device
  under ``tf.name_scope(...)`` without any tower object. The recognized
  conventions, each matched against a *whole* path component of the name
  scope (``xtower1`` or ``tower1x`` are not towers):

  ========================  ==========================================
  pattern                   used by
  ========================  ==========================================
  ``tower<i>``              tensorpack, this library, many scripts
  ``tower_<i>``             ``cifar10_multi_gpu_train.py``, ``inception_train.py``
  ``clone_<i>``             tf-slim's ``model_deploy`` (``train_image_classifier.py``)
  ========================  ==========================================

  Register another convention with :func:`register_tower_pattern`. A name
  scope gives the tower's index only, not how many towers there are: layers
  need ``num_dev`` for that.
* **tensorpack's tower context** (``tensorpack.tfutils.tower``), when
  tensorpack is imported and one is active: it gives the index, the total,
  ``is_training``, the main training tower and the variable scope of
  replicated training. tensorpack is never imported here: a script that uses
  its contexts has imported it already.
* **TensorFlow's own distribution strategies** (``tf.distribute``) in a TF1
  graph: inside ``strategy.run(fn)`` (``MirroredStrategy``,
  ``CentralStorageStrategy``, ``MultiWorkerMirroredStrategy``), each replica
  is a tower: its index and the group come from the replica context
  (``replica_id_in_sync_group``, ``num_replicas_in_sync``), the worker's
  own replicas are its towers, and the other workers' replicas make the
  group larger (``workers``). Replica ``i > 0`` builds under the name scope
  ``replica_<i>/``. Strategies of one replica (``OneDeviceStrategy``, the
  default strategy) are no tower at all. Under a strategy every replica
  builds the moving-average updates (``replicated_updates``): the strategy
  merges them, for variables created with ``ONLY_FIRST_REPLICA``
  aggregation, into one update per variable copy and step.
* This library's own :class:`tower.TowerContext` (handled in
  :mod:`tower.context`, which asks this module for the others).
"""

import re
import sys
import threading

__all__ = ['register_tower_pattern', 'unregister_tower_pattern', 'tower_patterns',
           'tower_index_of_component', 'HarnessTowerContext', 'tensorpack_tower_context',
           'distribute_replica_context']

# Each pattern matches one whole path component and captures the tower index.
_DEFAULT_PATTERNS = (r'tower([0-9]+)', r'tower_([0-9]+)', r'clone_([0-9]+)')
_PATTERNS = [re.compile(p) for p in _DEFAULT_PATTERNS]
_LOCK = threading.Lock()


def register_tower_pattern(pattern):
    """Recognizes another name-scope convention for towers.

    Example, for a script that builds ``with tf.name_scope('gpu%d' % i)``::

        tower.register_tower_pattern(r'gpu([0-9]+)')

    The pattern must match a whole path component of the name scope and
    capture the tower index in its only group. :func:`tower.strip_tower_prefix`
    then removes such components too, so that names shared by the towers agree.

    Args:
      pattern: a regular expression string with exactly one capturing group
        of digits.

    Raises:
      TypeError: if ``pattern`` is not a string.
      ValueError: if it does not compile, has not exactly one group, or
        contains ``/`` (it matches one component).
    """
    if not isinstance(pattern, str):
        raise TypeError('register_tower_pattern: pattern must be a string, got %r.'
                        % (pattern,))
    if '/' in pattern:
        raise ValueError('register_tower_pattern: %r contains "/"; a pattern matches one '
                         'path component of the name scope.' % pattern)
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError('register_tower_pattern: %r is not a regular expression (%s).'
                         % (pattern, e))
    if compiled.groups != 1:
        raise ValueError('register_tower_pattern: %r must have exactly one capturing group '
                         '(the tower index), it has %d.' % (pattern, compiled.groups))
    with _LOCK:
        if all(p.pattern != pattern for p in _PATTERNS):
            _PATTERNS.append(compiled)


def unregister_tower_pattern(pattern):
    """Forgets a pattern added with :func:`register_tower_pattern`.

    The built-in patterns cannot be removed.

    Raises:
      ValueError: if ``pattern`` is built in or was never registered.
    """
    if pattern in _DEFAULT_PATTERNS:
        raise ValueError('unregister_tower_pattern: %r is built in.' % (pattern,))
    with _LOCK:
        for i, p in enumerate(_PATTERNS):
            if p.pattern == pattern:
                del _PATTERNS[i]
                return
    raise ValueError('unregister_tower_pattern: %r was not registered.' % (pattern,))


def tower_patterns():
    """The recognized tower name patterns, built-in ones first."""
    with _LOCK:
        return tuple(p.pattern for p in _PATTERNS)


def tower_index_of_component(component):
    """The tower index if the path component ``component`` names a tower, else None."""
    with _LOCK:
        patterns = list(_PATTERNS)
    for p in patterns:
        match = p.fullmatch(component)
        if match:
            return int(match.group(1))
    return None


class HarnessTowerContext(object):
    """A read-only view of another harness's tower context.

    It has the properties of :class:`tower.TowerContext` that layers read:
    ``name``, ``ns_name``, ``vs_name``, ``index``, ``total``, ``is_training``
    and ``is_main_training_tower``, plus:

    * ``source``: the harness's name;
    * ``workers``: how many processes build ``total`` towers each into one
      group (``MultiWorkerMirroredStrategy``; 1 elsewhere);
    * ``replicated_updates``: every tower builds the moving-average updates,
      and the harness merges them (``tf.distribute``); else only the main
      training tower does. Such a harness also knows every member of the
      group: a backend must synchronize exactly ``total * workers`` members.
    """

    def __init__(self, source, ns_name, vs_name, index, total, is_training,
                 is_main_training_tower, workers=1, replicated_updates=False):
        self.source = source
        self.workers = workers
        self.replicated_updates = replicated_updates
        self.ns_name = ns_name
        self.name = ns_name.rsplit('/', 1)[-1] if ns_name else ''
        self.vs_name = vs_name
        self.index = index
        self.total = total
        self.is_training = is_training
        self.is_main_training_tower = is_main_training_tower

    def __repr__(self):
        workers = ', workers=%d' % self.workers if self.workers != 1 else ''
        return ('%s tower context(ns_name=%r, index=%d, total=%d%s, is_training=%r, '
                'vs_name=%r)' % (self.source, self.ns_name, self.index, self.total, workers,
                                 self.is_training, self.vs_name))


def tensorpack_tower_context():
    """tensorpack's active tower context as a :class:`HarnessTowerContext`, or None.

    None when tensorpack's tower module was never imported (tensorpack stays
    an optional dependency) or no tensorpack tower is being built.
    ``PredictTowerContext`` has no index: it counts as tower 0 of 1, not
    training and not the main training tower.
    """
    module = sys.modules.get('tensorpack.tfutils.tower')
    if module is None:
        return None
    ctx = module.get_current_tower_context()
    if ctx is None:
        return None
    is_training = bool(ctx.is_training)
    index = int(getattr(ctx, 'index', 0)) if is_training else 0
    total = int(getattr(ctx, 'total', 1)) if is_training else 1
    return HarnessTowerContext('tensorpack', ctx.ns_name or '', ctx.vs_name or '', index,
                               total, is_training, bool(ctx.is_main_training_tower))


_REPLICA_SCOPE = re.compile(r'replica_([0-9]+)')


def distribute_replica_context(name_scope):
    """The ``tf.distribute`` replica being built, as a :class:`HarnessTowerContext`, or None.

    None outside ``strategy.run`` (no strategy, or its cross-replica
    context) and for strategies of one replica in sync. The tower is the
    replica's index among this worker's replicas; ``workers`` is
    ``num_replicas_in_sync`` over this worker's replicas.

    Args:
      name_scope: the current full name scope, where replica ``i > 0`` of
        this worker has its ``replica_<i>`` component.

    Raises:
      ValueError: when the replica's index is not known at graph build.
    """
    import tensorflow as tf  # noqa: PLC0415 - already imported by any graph that gets here
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    replica = tf.distribute.get_replica_context()
    if replica is None or replica.num_replicas_in_sync <= 1:
        return None
    replica_id = tf.get_static_value(replica.replica_id_in_sync_group)
    if replica_id is None:
        raise ValueError('tf1_syncbn: the tf.distribute replica context does not know its '
                         'replica_id_in_sync_group at graph build; build the model with '
                         'strategy.run in a TF1 graph (tf.compat.v1.distribute strategies).')
    replicas = replica.num_replicas_in_sync
    local = len(replica.strategy.extended.worker_devices)
    if local < 1 or replicas % local:
        raise ValueError('tf1_syncbn: tf.distribute reports %d replicas in sync but %d local '
                         'devices; every worker must run the same number of replicas.'
                         % (replicas, local))
    index = int(replica_id) % local
    ns_name = ''
    parts = name_scope.split('/') if name_scope else []
    for i, part in enumerate(parts):
        match = _REPLICA_SCOPE.fullmatch(part)
        if match and int(match.group(1)) == index:
            ns_name = '/'.join(parts[:i + 1])
            break
    return HarnessTowerContext('tf.distribute %s' % type(replica.strategy).__name__, ns_name,
                               '', index, local, True, int(replica_id) == 0,
                               workers=replicas // local, replicated_updates=True)
