"""Check a training graph's batch norm: :func:`audit_graph`, ``python -m tf1_syncbn.audit``.

Finds every batch-norm layer of a graph, this library's and plain ones
(``FusedBatchNorm*`` or ``tf.nn.moments`` batch norm from slim, tensorpack,
``tf.layers`` or Keras), with its towers (``tower<i>``, ``tower_<i>``,
``clone_<i>``, registered patterns, tensorpack's ``tower<i>``,
``tf.distribute``'s ``replica_<i>``), and reports as problems:

* a layer built in more than one tower that normalizes each tower with its
  own batch's statistics (or synchronizes only some towers);
* moving-average updates that do not run when the train op runs (reachable
  from it through data or control edges, the layer's own output included:
  ``updates_collections=None``);
* a moving variable assigned by more than one update op in one step;
* a synchronized layer whose all-reduce group is smaller than the towers
  that build it.

Inference-mode layers in a training tower are reported as notes only. The
audit reads the graph's structure only (ops, types, attributes, inputs,
control inputs and the function library, where a tensor ``is_training``
puts the training computation in ``tf.cond`` branches), so it works on a
graph imported from an exported ``MetaGraphDef``, and from the command line::

    python -m tf1_syncbn.audit MODEL.meta [--train-op NAME] [--tower-pattern REGEX]

which prints the report and exits with status 1 when there are problems
(2 on a usage error), for CI.

Where each part lives: :mod:`~tf1_syncbn.audit.graph` reads a graph (its
function library and meta graphs included) into an index;
:mod:`~tf1_syncbn.audit.layers` finds the batch-norm layers and their towers;
:mod:`~tf1_syncbn.audit.facts` gathers what is known of each layer (a typed
record); :mod:`~tf1_syncbn.audit.rules` holds the one list of checks
(``RULES``, a function each) and :func:`audit_graph`, which applies them;
:mod:`~tf1_syncbn.audit.report` is the report; :mod:`~tf1_syncbn.audit.command`
the command line.
"""

from tf1_syncbn.audit.command import main, read_meta_graph
from tf1_syncbn.audit.report import AuditReport, LayerAudit
from tf1_syncbn.audit.rules import audit_graph

__all__ = ['audit_graph', 'read_meta_graph', 'main', 'AuditReport', 'LayerAudit']
