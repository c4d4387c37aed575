"""The pipeline every call runs (private): :func:`tf1_syncbn._core.call.batch_norm`.

In the order a call goes through it:

* :mod:`~tf1_syncbn._core.options`: every option and the input, checked at
  graph build, into a frozen ``Options`` and a ``Layout``;
* :mod:`~tf1_syncbn._core.variables`: the ``Params`` the core reads, renorm,
  zero-debias and custom getters' variables;
* :mod:`~tf1_syncbn._core.call`: :func:`~tf1_syncbn._core.call.batch_norm`:
  call site -> plan (:mod:`tf1_syncbn._sync`) -> normalize -> updates;
* :mod:`~tf1_syncbn._core.normalize`: the training paths and inference,
  on the kernel sets (:mod:`tf1_syncbn.kernel_sets`, :mod:`tf1_syncbn._compute`);
* :mod:`~tf1_syncbn._core.updates`: the moving averages, built once and
  shared with every tower;
* :mod:`~tf1_syncbn._core.records`: what :mod:`tf1_syncbn.export` reads of each call;
* :mod:`~tf1_syncbn._core.moments`: the moments of the global batch that
  ``tf1_syncbn.moments`` / ``weighted_moments`` (:mod:`tf1_syncbn.nn`)
  return, through the same call site and plan.

The front-ends reach it through one door,
:mod:`tf1_syncbn._frontend.building`; the export reads its records.
"""
