"""The runner's report: one screen on stderr per graph, and the ``--report`` JSON file.

:func:`text` is what ``python -m tf1_syncbn.run`` prints before a graph's
first training step: what was switched, the batch-norm layers grouped by
towers, synchronization and updates (one row per group, so that a ResNet's
fifty layers take one or two rows), the audit's problems (each naming the
layer and the fix; the first :data:`SHOWN_PROBLEMS`) and the verdict.
:func:`payload` is the JSON document of every graph audited so far, with each
audit in full (:func:`tf1_syncbn.audit.report.as_dict`).
"""

import collections
import json
import os
import sys

from tf1_syncbn.audit.report import as_dict
from tf1_syncbn.run.startup import STRICT_EXIT_STATUS

__all__ = ['Switch', 'GraphProof', 'text', 'payload', 'write_json', 'report_path',
           'SHOWN_PROBLEMS', 'FORMAT']

#: The problems printed on the screen (all of them go into the JSON file).
SHOWN_PROBLEMS = 8
#: The JSON document's ``format``.
FORMAT = 'tf1_syncbn.run/1'
_PREFIX = 'tf1_syncbn.run'


class Switch(object):
    """What the runner did with one front-end.

    Attributes:
      front_end: ``'tf.layers'``, ``'tf-slim'``, ``'Keras 2'`` or ``'tensorpack'``.
      status: ``'switched'``, ``'not loaded'`` (its library is not imported:
        switched when it is) or ``'failed'``.
      defaults: the layers' defaults it set (``{'sync_statistics': 'auto', ...}``).
      error: why it failed (a message), or None.
    """

    def __init__(self, front_end, status='not loaded', defaults=None, error=None):
        self.front_end = front_end
        self.status = status
        self.defaults = dict(defaults or {})
        self.error = error

    def as_dict(self):
        return {'front_end': self.front_end, 'status': self.status,
                'defaults': self.defaults, 'error': self.error}


class GraphProof(object):
    """One graph's audit at its first training step.

    Attributes:
      number: 1 for the first graph that trained in the process, 2 for the next, ...
      train_op: the names of the ops that step runs (its fetches).
      audit: the :class:`~tf1_syncbn.audit.AuditReport`, or None when the audit raised.
      error: what the audit raised (a message), or None.
      stopped: whether ``--strict`` stopped the run here.
    """

    def __init__(self, number, train_op, audit=None, error=None):
        self.number = number
        self.train_op = list(train_op)
        self.audit = audit
        self.error = error
        self.stopped = False

    @property
    def ok(self):
        return self.error is None and self.audit.ok

    def as_dict(self):
        return {'graph': self.number, 'train_op': self.train_op, 'ok': self.ok,
                'stopped': self.stopped, 'error': self.error,
                'audit': as_dict(self.audit) if self.audit is not None else None}


def _defaults_text(defaults):
    return ', '.join('%s=%r' % item for item in defaults.items() if item[1] is not None)


def switched_line(switches):
    """``switched: tf.layers, tf-slim (sync_statistics='auto', num_dev=4); not loaded: ...``."""
    by_status = collections.OrderedDict()
    for switch in switches:
        by_status.setdefault(switch.status, []).append(switch)
    parts = []
    for status, group in by_status.items():
        if status == 'switched':
            defaults = {}
            for switch in group:
                defaults.update(switch.defaults)
            parts.append('switched: %s (%s)' % (', '.join(s.front_end for s in group),
                                                 _defaults_text(defaults)))
        elif status == 'failed':
            parts.extend('NOT SWITCHED: %s (%s)' % (s.front_end, s.error) for s in group)
        else:
            parts.append('%s: %s' % (status, ', '.join(s.front_end for s in group)))
    return '; '.join(parts)


def _names(names):
    if len(names) == 1:
        return names[0]
    shown = ', '.join(names[:3]) + (', ...' if len(names) > 3 else '')
    return '%d layers: %s' % (len(names), shown)


def _table(audit):
    """The layers, one row per group of equal towers, mode, synchronization and updates."""
    groups = collections.OrderedDict()
    for layer in audit.layers:
        key = (layer.towers_summary(), layer.mode, layer.sync_summary(), layer.updates)
        groups.setdefault(key, []).append(layer.name)
    header = ('layers', 'towers', 'mode', 'sync', 'updates')
    rows = [(_names(names),) + key for key, names in groups.items()]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return ['  ' + '  '.join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
            for row in [header, tuple('-' * w for w in widths)] + rows]


def text(proof, switches, strict):
    """The report of one graph's first training step (ends with a newline)."""
    shown = proof.train_op[:3] + (['... (%d ops)' % len(proof.train_op)]
                                  if len(proof.train_op) > 3 else [])
    lines = ['%s: batch-norm audit of graph %d before its first training step (train op: %s)'
             % (_PREFIX, proof.number, ', '.join(shown) or '?'),
             '  ' + switched_line(switches)]
    if proof.error is not None:
        lines.append('  THE AUDIT FAILED: %s' % proof.error)
    else:
        audit = proof.audit
        if audit.layers:
            lines.extend(_table(audit))
        else:
            lines.append('  no batch-norm layer in this graph')
        if audit.problems:
            lines.append('  PROBLEMS (%d):' % len(audit.problems))
            lines.extend('    - ' + p for p in audit.problems[:SHOWN_PROBLEMS])
            if len(audit.problems) > SHOWN_PROBLEMS:
                lines.append('    ... and %d more (all of them: --report PATH)'
                             % (len(audit.problems) - SHOWN_PROBLEMS))
    problems = 1 if proof.error is not None else len(proof.audit.problems)
    if proof.ok:
        lines.append('%s: OK: every batch norm trained in several towers is synchronized, and '
                     'every one updates its moving statistics.' % _PREFIX)
    elif strict:
        lines.append('%s --strict: %d problem%s: stopped before the first training step '
                     '(exit status %d).' % (_PREFIX, problems, '' if problems == 1 else 's',
                                            STRICT_EXIT_STATUS))
    else:
        lines.append('%s: %d problem%s: training goes on (--strict stops before the first '
                     'step).' % (_PREFIX, problems, '' if problems == 1 else 's'))
    return '\n'.join(lines) + '\n'


def _worker(environ):
    """``(this worker's rank, the number of workers)`` from ``TF_CONFIG``; ``(0, 1)`` without."""
    try:
        config = json.loads(environ.get('TF_CONFIG') or '{}')
        cluster, task = config.get('cluster', {}), config.get('task', {})
        chiefs, workers = len(cluster.get('chief', [])), len(cluster.get('worker', []))
        index = int(task.get('index', 0))
        rank = index if task.get('type') != 'worker' else index + chiefs
        return rank, chiefs + workers or 1
    except (ValueError, TypeError, AttributeError):
        return 0, 1


def report_path(template, environ=None):
    """Where this process writes ``--report``: ``{worker}`` and ``{pid}`` replaced.

    Without ``{worker}`` in a job of several workers (``TF_CONFIG``), worker
    ``i`` writes ``PATH.worker<i>`` (before the extension), so that workers
    never overwrite each other's reports.
    """
    environ = os.environ if environ is None else environ
    rank, workers = _worker(environ)
    path = template.replace('{pid}', str(os.getpid())).replace('{worker}', str(rank))
    if '{worker}' not in template and workers > 1:
        root, extension = os.path.splitext(path)
        path = '%s.worker%d%s' % (root, rank, extension)
    return path


def payload(proofs, switches, options, stopped=False):
    """The ``--report`` document: the process, the options, the switches and every graph."""
    rank, workers = _worker(os.environ)
    return {'format': FORMAT, 'argv': list(sys.argv), 'pid': os.getpid(), 'worker': rank,
            'workers': workers,
            'options': {'num_dev': options.num_dev, 'group_size': options.group_size,
                        'backend': options.backend, 'timeout': options.timeout,
                        'strict': options.strict},
            'switched': [s.as_dict() for s in switches],
            'graphs': [p.as_dict() for p in proofs],
            'ok': all(p.ok for p in proofs), 'stopped': stopped}


def write_json(path, document):
    """Writes ``document`` to ``path`` at once (a temporary file, then ``os.replace``)."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    temporary = '%s.tmp%d' % (path, os.getpid())
    with open(temporary, 'w') as f:
        json.dump(document, f, indent=1)
        f.write('\n')
    os.replace(temporary, path)
