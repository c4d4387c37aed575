"""Computation (private): the math of synchronized batch norm, and its gradients.

* :mod:`~tf1_syncbn._compute.math`: pure functions on a 4-D view (moments,
  packing, global statistics, normalize, gradient sums);
* :mod:`~tf1_syncbn._compute.engine`: the synchronized computations (the
  fused op with its gradient, the differentiable all-reduce, ghost moments);
* :mod:`~tf1_syncbn._compute.gradients`: custom gradients that do not keep
  their graph alive, and the backends' all-reduce ops as constants for
  ``tf.gradients``;
* :mod:`~tf1_syncbn._compute.xla`: the library's ops kept out of XLA's
  auto-clustering.

The per-device kernel sets built on it are :mod:`tf1_syncbn.kernel_sets`.
Imports only :mod:`tf1_syncbn.backends` (op types) and :mod:`tower`.
"""
