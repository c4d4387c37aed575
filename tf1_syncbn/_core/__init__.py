"""The core every front-end calls (private): :func:`tf1_syncbn._core.call.batch_norm`.

In the order a call goes through it:

* :mod:`~tf1_syncbn._core.options`: every option and the input, checked at
  graph build, into a frozen ``Options`` and a ``Layout``;
* :mod:`~tf1_syncbn._core.variables`: the ``Params`` the core reads, renorm,
  zero-debias and custom getters' variables;
* :mod:`~tf1_syncbn._core.axes`: any channel axes as a view with one;
* :mod:`~tf1_syncbn._core.call`: :func:`~tf1_syncbn._core.call.batch_norm`:
  group -> plan (:mod:`tf1_syncbn._sync`) -> normalize -> updates;
* :mod:`~tf1_syncbn._core.normalize`: the training paths and inference,
  on the kernel sets (:mod:`tf1_syncbn.kernel_sets`, :mod:`tf1_syncbn._compute`);
* :mod:`~tf1_syncbn._core.updates`: the moving averages, built once and
  shared with every tower;
* :mod:`~tf1_syncbn._core.records`: what :mod:`tf1_syncbn.export` reads of each call;
* :mod:`~tf1_syncbn._core.moments`: ``tf1_syncbn.moments`` / ``weighted_moments``
  (``tf.nn``'s over every tower's batch), through the same group and plan.

And what the front-ends share besides: :mod:`~tf1_syncbn._core.keras2` (the
Keras 2 the tf.layers and Keras front-ends replace),
:mod:`~tf1_syncbn._core.patching` (the patches' base, :class:`~tf1_syncbn._core.patching.Patch`, and
their check) and :mod:`~tf1_syncbn._core.modules` (the loaded modules'
namespaces, read without running their hooks).
"""
