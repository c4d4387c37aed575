"""Tower contexts for multi-tower (one replica per device) TF1 graphs.

Public API:

* :class:`TowerContext`: build one tower (name scope, index, total, training).
* :func:`get_current_tower_context`: the innermost tower of the current graph.
* :func:`strip_tower_prefix`: a name shared by all towers.
* :func:`call_for_each_tower`: build a function once per device.
* :func:`average_gradients`: average per-tower gradients.
* :func:`virtual_cpu_config`: a ``ConfigProto`` with N CPU devices.
* :func:`register_tower_pattern`: recognize another name-scope convention for
  towers (see :mod:`tower.harness` for the built-in ones and tensorpack).
"""

from tower.context import (TowerContext, get_current_tower_context, strip_tower_prefix,
                           tower_index_from_name)
from tower.harness import register_tower_pattern, tower_patterns, unregister_tower_pattern
from tower.training import average_gradients, call_for_each_tower, virtual_cpu_config

__all__ = ['TowerContext', 'get_current_tower_context', 'strip_tower_prefix',
           'tower_index_from_name', 'call_for_each_tower', 'average_gradients',
           'virtual_cpu_config', 'register_tower_pattern', 'unregister_tower_pattern',
           'tower_patterns']
