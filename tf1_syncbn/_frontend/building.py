"""What a front-end builds one call of the core with: its one door to the pipeline.

A front-end's ``layer.py`` checks the user's arguments in its library's
words, creates the variables by its library's names, and makes one call of
the core; its ``rules.py`` decides what its library would (which variance
the moving variance tracks, ...). Everything they use of the library is
here, in the order a call uses it:

* the checks: :func:`check_graph_mode`, :func:`check_dict_keys`,
  :func:`check_options` (every option, into a frozen ``Options``),
  :func:`check_inputs` (the input, into a ``Layout``) and
  :func:`replaced_layer_is_fused` (the fused rule the front-ends' rules
  share), from :mod:`tf1_syncbn._core.options`;
* the views of any channel axes (a middle axis, several axes) with one, which
  the core normalizes: :func:`needs_view`, :func:`plan_view`, :func:`to_view`,
  :func:`from_view`, :func:`adjustment_in_view`, :func:`parameter_shape`
  (:mod:`tf1_syncbn._frontend.axes`);
* the variables: :class:`Params` (what the core reads),
  :class:`RenormVariables`, :func:`received_variables` (what a custom getter
  received), :func:`zero_debias_variables`, :func:`assignable`,
  :data:`STATISTICS_AGGREGATION`, :data:`FINETUNE_COUNTERS`
  (:mod:`tf1_syncbn._core.variables`);
* the call: :func:`batch_norm` (:mod:`tf1_syncbn._core.call`), and for
  hand-written batch norm :func:`moments_scope` and :func:`global_moments`
  (:mod:`tf1_syncbn._core.moments`);
* tf-keras' rules shared by the tf.layers and Keras front-ends:
  :func:`ghost_batches_in_training`, :func:`keras2_package`
  (:mod:`tf1_syncbn._frontend.keras2`);
* :func:`graph_cache`, for what a front-end keeps per graph (tf.layers'
  numbering of unnamed layers).
"""

from tf1_syncbn._core.call import batch_norm
from tf1_syncbn._core.moments import global_moments, moments_scope
from tf1_syncbn._core.options import (check_dict_keys, check_graph_mode, check_inputs,
                                      check_options, replaced_layer_is_fused)
from tf1_syncbn._core.variables import (FINETUNE_COUNTERS, STATISTICS_AGGREGATION, Params,
                                        RenormVariables, assignable, received_variables,
                                        zero_debias_variables)
from tf1_syncbn._frontend.axes import (adjustment_in_view, from_view, needs_view,
                                       parameter_shape, plan_view, to_view)
from tf1_syncbn._frontend.keras2 import ghost_batches_in_training
from tf1_syncbn._frontend.keras2 import package as keras2_package
from tf1_syncbn._graph.cache import graph_cache

__all__ = [
    'check_graph_mode', 'check_dict_keys', 'check_options', 'check_inputs',
    'replaced_layer_is_fused',
    'needs_view', 'plan_view', 'to_view', 'from_view', 'adjustment_in_view', 'parameter_shape',
    'Params', 'RenormVariables', 'received_variables', 'zero_debias_variables', 'assignable',
    'STATISTICS_AGGREGATION', 'FINETUNE_COUNTERS',
    'batch_norm', 'moments_scope', 'global_moments',
    'ghost_batches_in_training', 'keras2_package',
    'graph_cache',
]
