"""The command line of the audit, ``python -m tf1_syncbn.audit``: :func:`main`, and
:func:`read_meta_graph`, which reads an exported ``MetaGraphDef`` without building it."""

import sys

from google.protobuf import message, text_format
from tensorflow.core.protobuf import meta_graph_pb2

from tf1_syncbn._cli import audit_parser
from tf1_syncbn.audit.rules import audit_graph

__all__ = ['read_meta_graph', 'main']


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
