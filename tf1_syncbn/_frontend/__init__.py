"""What the front-ends share (private): the two doors to the library, and what stands behind them.

A front-end (:mod:`tf1_syncbn.slim`, :mod:`~tf1_syncbn.tensorpack`,
:mod:`~tf1_syncbn.layers`, :mod:`~tf1_syncbn.keras`, :mod:`~tf1_syncbn.nn`)
imports two private modules at most, both here:

* :mod:`~tf1_syncbn._frontend.building`: what its ``layer.py`` and ``rules.py``
  build one call of the core with (the checks into ``Options``, the
  variables' helpers, ``batch_norm``, the views of any channel axes,
  tf-keras' shared rules);
* :mod:`~tf1_syncbn._frontend.patching`: what its ``patch.py`` switches the
  user's code with (the :class:`~tf1_syncbn._frontend.patching.Patch` base,
  its check of the names users call, the loaded modules' namespaces).

Behind them, the kit the two serve: :mod:`~tf1_syncbn._frontend.axes` (any
channel axes as a view with one), :mod:`~tf1_syncbn._frontend.keras2` (which
Keras 2 package ``tf.keras`` is, and tf-keras' ghost-batch rule) and
:mod:`~tf1_syncbn._frontend.modules` (the loaded modules' namespaces, read
without running their hooks). The pipeline every call runs is
:mod:`tf1_syncbn._core`, below.
"""
