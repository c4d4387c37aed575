"""Inference graphs from training graphs: a frozen ``GraphDef`` or a SavedModel.

A training graph of this library's layers holds what serving cannot load:
all-reduces between towers (``CollectiveReduce``, ``NcclAllReduce``, Horovod's), the
compiled kernels and the step watchdog (``SyncBn*`` ops), and, with a tensor
``is_training``, a ``tf.cond`` per layer whose training branch holds them.
TensorFlow's own ``convert_variables_to_constants`` keeps all of them, even
on the inference outputs of one tower.

:func:`inference_graph_def` takes a session holding a trained graph (built
with any front-end, on any number of towers, with a Python or tensor
``is_training``; also one imported with ``import_meta_graph`` and restored)
and returns a frozen ``GraphDef`` of the outputs you name, usually tower 0's,
in which every batch-norm call is one inference ``FusedBatchNormV3`` with the
moving statistics (as the layers compute with ``is_training=False``; renorm
and ``fused=False`` layers included). :func:`export_saved_model` writes the
same graph as a SavedModel with a ``serving_default`` signature. Both hold
plain TensorFlow ops only: they load and run where this library is not
installed (``tf.saved_model.load``, TensorFlow Serving, ``tf.import_graph_def``).

How: every layer call records in its graph what such an op needs (its input
and output, variables, epsilon and layout; :mod:`tf1_syncbn._core.records`,
a collection of strings, which meta graphs keep). The exporter imports the
graph into a fresh one (with the named inputs as new placeholders whose batch
dimension is free, and the named constants fed in), builds the inference op
of each layer from its record, points the consumers of the layer's output at
it, keeps the part of the graph the outputs need, and freezes its variables
with ``convert_variables_to_constants``. The session's graph is not changed.

Example (tower 0 of a 4-tower training graph, ``is_training`` a placeholder)::

    # Fragment
    graph_def = tf1_syncbn.export.inference_graph_def(
        sess, inputs={'images': image_parts[0]}, outputs={'logits': tower_logits[0]},
        constants={is_training: False})
    tf1_syncbn.export.export_saved_model(sess, 'serving/1', {'images': image_parts[0]},
                                         {'logits': tower_logits[0]}, {is_training: False})

Layers built inside a user's ``tf.cond``/``tf.while_loop`` function body
(control flow v2) cannot be rewired; the exporter then fails, naming them.
Arguments that would export something else than they say (a placeholder
left at its default, the full batch where a tower's share was meant, a
constant that does not fit its tensor) fail too, naming the argument.

The modules: :mod:`~tf1_syncbn.export.inference` (the two functions),
:mod:`~tf1_syncbn.export.twins` (each call's inference op, from its record),
:mod:`~tf1_syncbn.export.graph_defs` (the ``GraphDef`` surgery),
:mod:`~tf1_syncbn.export.checks` (what is checked of the arguments and of the
exported graph).
"""

from tf1_syncbn.export.checks import FORBIDDEN_OP_PREFIXES
from tf1_syncbn.export.inference import export_saved_model, inference_graph_def

__all__ = ['inference_graph_def', 'export_saved_model', 'FORBIDDEN_OP_PREFIXES']
