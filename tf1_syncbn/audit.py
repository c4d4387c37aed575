"""Check a training graph's batch norm: :func:`audit_graph` and ``python -m tf1_syncbn.audit``.

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
"""

import sys

from google.protobuf import message, text_format
from tensorflow.core.protobuf import meta_graph_pb2

from tf1_syncbn._audit_rules import audit_graph
from tf1_syncbn._cli import audit_parser

__all__ = ['audit_graph', 'read_meta_graph', 'main']


def read_meta_graph(path):
    """Reads an exported ``MetaGraphDef``, for :func:`audit_graph`.

    Args:
      path: a file written by ``tf.compat.v1.train.export_meta_graph`` (binary,
        or text with ``as_text=True``).

    Returns:
      The ``MetaGraphDef``; no TensorFlow graph is built, so graphs with ops
      this process has no kernel for (a compiled library's, Horovod's) read too.

    Raises:
      OSError: the file cannot be read.
      ValueError: it holds no MetaGraphDef with a graph.
    """
    with open(path, 'rb') as f:
        data = f.read()
    meta = meta_graph_pb2.MetaGraphDef()
    try:
        meta.ParseFromString(data)
    except message.DecodeError:
        meta.Clear()
    if not meta.graph_def.node:
        try:
            text_format.Parse(data.decode('utf-8'), meta)
        except (UnicodeDecodeError, text_format.ParseError):
            pass
    if not meta.graph_def.node:
        raise ValueError('%s holds no MetaGraphDef with a graph (write one with '
                         'tf.compat.v1.train.export_meta_graph(filename=...)).' % path)
    return meta


def main(argv=None):
    """``python -m tf1_syncbn.audit``: prints the audit of an exported graph.

    Args:
      argv: the arguments without the program name (default ``sys.argv[1:]``).

    Returns:
      The exit status: 0 when the graph has no problem, 1 when it has, 2 when
      the file or the arguments are wrong.
    """
    parser = audit_parser()
    args = parser.parse_args(argv)
    try:
        report = audit_graph(read_meta_graph(args.meta_graph), args.train_op,
                             args.tower_pattern)
    except (OSError, ValueError, TypeError) as e:
        print('python -m tf1_syncbn.audit: error: %s' % e, file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


if __name__ == '__main__':
    sys.exit(main())
