"""The audit's report: :class:`AuditReport`, with one :class:`LayerAudit` per layer.

``str(report)`` is a table, one row per batch-norm layer, followed by the
problems (each naming the layer's scope and the fix) and the notes
(information only). ``report.ok`` is True when there is no problem.
"""

import re

__all__ = ['AuditReport', 'LayerAudit', 'format_towers', 'tower_sort_key', 'as_dict']

#: ``LayerAudit.updates`` values.
UPDATES_RUN = 'train_op'            # reachable from the train op
UPDATES_IN_LAYER = 'in layer'       # control dependencies of the layer's output (and reached)
UPDATES_NOT_RUN = 'NOT RUN'
UPDATES_NOT_CHECKED = 'not checked'  # no train op given
UPDATES_NONE = 'none built'
UPDATES_INFERENCE = '-'             # inference only: nothing to update
UPDATES_OUTSIDE = 'not in step'     # the train op does not run the layer's training copies


class LayerAudit(object):
    """One batch-norm layer (all its towers' copies).

    Attributes:
      name: the layer's scope without tower prefixes (``conv1/BatchNorm``).
      towers: the towers it appears in (``'tower0'``, ``'clone_1'``,
        ``'replica_1'``, ...; ``''`` for ops outside any tower), in order.
      training_towers: those where it normalizes with batch statistics
        (``is_training`` True, or a tensor that can be True).
      inference_towers: those where it normalizes with the moving statistics.
      mode: ``'train'``, ``'infer'`` or ``'train+infer'`` (a tensor
        ``is_training``, or training towers plus an inference path).
      computation: how it computes its batch statistics: ``'tf1_syncbn'``
        (this library's layers), ``'fused'`` (``FusedBatchNorm*``: slim,
        tf.layers, Keras, tensorpack), ``'moments'`` (``tf.nn.moments``) or
        ``'-'`` (inference only).
      synchronized: True when every training tower's copy all-reduces its
        statistics, False when none does, None when only some do.
      backend: ``'collective'``, ``'nccl'``, ``'horovod'`` or None.
      group_size: members of the all-reduce group (None when unknown or
        unsynchronized).
      groups: with sync groups (the layers' ``group_size``), the towers of
        each group, in order (``(('tower0', 'tower1'), ('tower2', 'tower3'))``);
        empty when one group holds every tower.
      collectives_per_step: all-reduce ops of this layer (every tower, forward
        and backward) that run in one training step (all of them when no
        train op was given).
      updates: whether its moving-average updates run with the train op:
        ``'train_op'``, ``'in layer'`` (``updates_collections=None``: control
        dependencies of the layer's output), ``'NOT RUN'``, ``'not checked'``
        (no train op), ``'not in step'`` (the train op does not run the
        layer), ``'none built'`` or ``'-'`` (inference only).
      update_ops: the names of its update ops (those run by the train op when
        one was given and some are).
      moving_variables: the names of its moving-statistic variables.
      devices: the devices its training copies were placed on (those that
        name one), in order.
      problems: this layer's entries of :attr:`AuditReport.problems`.
      notes: this layer's entries of :attr:`AuditReport.info` (for example, a
        layer applied to several inputs in one step).
    """

    def __init__(self, name, **fields):
        self.name = name
        self.towers = fields.pop('towers', ())
        self.training_towers = fields.pop('training_towers', ())
        self.inference_towers = fields.pop('inference_towers', ())
        self.mode = fields.pop('mode', 'train')
        self.computation = fields.pop('computation', '-')
        self.synchronized = fields.pop('synchronized', False)
        self.backend = fields.pop('backend', None)
        self.group_size = fields.pop('group_size', None)
        self.groups = tuple(tuple(g) for g in fields.pop('groups', ()))
        self.collectives_per_step = fields.pop('collectives_per_step', 0)
        self.updates = fields.pop('updates', UPDATES_NOT_CHECKED)
        self.update_ops = fields.pop('update_ops', ())
        self.moving_variables = fields.pop('moving_variables', ())
        self.devices = fields.pop('devices', ())
        self.problems = fields.pop('problems', [])
        self.notes = fields.pop('notes', [])
        if fields:
            raise TypeError('LayerAudit: unknown fields %s.' % ', '.join(sorted(fields)))

    def towers_summary(self):
        """The ``towers`` cell: training towers, then copies that only infer elsewhere."""
        if not self.training_towers:
            return format_towers(self.towers)
        others = [t for t in self.inference_towers if t not in self.training_towers]
        text = format_towers(self.training_towers)
        return text + ('; infer: ' + format_towers(others) if others else '')

    def sync_summary(self):
        """The ``sync`` cell of the table."""
        if self.mode == 'infer':
            return '-'
        if self.synchronized is False:
            if len(self.training_towers) > 1:
                return 'no (per tower)'
            return 'no (per device)' if len(self.devices) > 1 else 'no (one tower)'
        text = self.backend or 'yes'
        if self.groups:
            text += ' (%d groups: %s)' % (len(self.groups), ' | '.join(
                format_towers(towers) for towers in self.groups))
        elif self.group_size:
            text += ' (group %d)' % self.group_size
        text += ', %d all-reduces/step' % self.collectives_per_step
        if self.synchronized is None:
            text = 'PARTLY: ' + text
        return text

    def __repr__(self):
        return ('LayerAudit(%r, towers=%r, mode=%r, synchronized=%r, backend=%r, group_size=%r, '
                'updates=%r)' % (self.name, self.towers, self.mode, self.synchronized,
                                 self.backend, self.group_size, self.updates))


def tower_sort_key(label):
    """Sorts tower labels by prefix, then index (``tower2`` before ``tower10``)."""
    match = re.fullmatch(r'(.*?)([0-9]+)', label)
    return (match.group(1), int(match.group(2))) if match else (label, -1)


def format_towers(labels):
    """``['tower0', 'tower1', 'tower2']`` -> ``'tower0..tower2'``; ``''`` (no tower) -> ``'-'``."""
    labels = sorted(set(labels), key=tower_sort_key)
    if not labels:
        return '-'
    parts, run = [], []

    def flush():
        if len(run) > 2:
            parts.append('%s..%s' % (run[0], run[-1]))
        else:
            parts.extend(run)

    for label in labels:
        prefix, index = tower_sort_key(label)
        if run and tower_sort_key(run[-1]) == (prefix, index - 1):
            run.append(label)
            continue
        flush()
        run = [label]
    flush()
    return ', '.join(p or '(no tower)' for p in parts)


class AuditReport(object):
    """The audit of one graph.

    Attributes:
      layers: one :class:`LayerAudit` per batch-norm layer, by name.
      problems: strings, each naming a layer's scope and the fix; empty for
        a correct graph.
      info: notes that are not problems (inference-mode layers in a
        training tower, checks that needed a train op).
      train_op: the names of the ops the updates were checked against (empty
        when none was given or found).
      towers: every tower that builds a batch-norm layer.
    """

    def __init__(self, layers, problems, info, train_op, towers):
        self.layers = list(layers)
        self.problems = list(problems)
        self.info = list(info)
        self.train_op = tuple(train_op)
        self.towers = tuple(towers)

    @property
    def ok(self):
        """True when the audit found no problem (notes do not count)."""
        return not self.problems

    def __repr__(self):
        return 'AuditReport(ok=%r, layers=%d, problems=%d)' % (self.ok, len(self.layers),
                                                               len(self.problems))

    def __str__(self):
        lines = ['Batch-norm audit: %d layer%s in %s; train op: %s' % (
            len(self.layers), '' if len(self.layers) == 1 else 's',
            'towers %s' % format_towers(self.towers) if any(self.towers) else 'one tower',
            ', '.join(self.train_op) or 'none given (updates not checked)')]
        if self.layers:
            header = ('layer', 'towers', 'mode', 'sync', 'updates')
            rows = [(layer.name, layer.towers_summary(), layer.mode, layer.sync_summary(),
                     layer.updates) for layer in self.layers]
            widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
            for row in [header, tuple('-' * w for w in widths)] + rows:
                lines.append('  '.join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if self.problems:
            lines.append('PROBLEMS (%d):' % len(self.problems))
            lines.extend('  - ' + p for p in self.problems)
        if self.info:
            lines.append('Notes:')
            lines.extend('  - ' + n for n in self.info)
        lines.append('OK: no problems found.' if self.ok else
                     'FAILED: %d problem%s.' % (len(self.problems),
                                               '' if len(self.problems) == 1 else 's'))
        return '\n'.join(lines)


#: The fields of a :class:`LayerAudit` that :func:`as_dict` writes, in order.
LAYER_FIELDS = ('name', 'towers', 'training_towers', 'inference_towers', 'mode', 'computation',
                'synchronized', 'backend', 'group_size', 'groups', 'collectives_per_step',
                'updates', 'update_ops', 'moving_variables', 'devices', 'problems', 'notes')


def as_dict(report):
    """The report as a dict of JSON types (``json.dumps`` writes it as it is).

    ``{'ok', 'train_op', 'towers', 'problems', 'notes', 'layers': [{field:
    value}]}``, each layer with the attributes of :class:`LayerAudit`
    (:data:`LAYER_FIELDS`; tuples become lists) and its table cells
    (``'towers_summary'``, ``'sync_summary'``). ``python -m tf1_syncbn.run
    --report PATH`` writes it.
    """
    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    layers = []
    for layer in report.layers:
        entry = {field: plain(getattr(layer, field)) for field in LAYER_FIELDS}
        entry['towers_summary'] = layer.towers_summary()
        entry['sync_summary'] = layer.sync_summary()
        layers.append(entry)
    return {'ok': report.ok, 'train_op': list(report.train_op), 'towers': list(report.towers),
            'problems': list(report.problems), 'notes': list(report.info), 'layers': layers}
