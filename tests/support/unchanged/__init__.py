"""Unchanged TF1 scripts of each classic multi-tower style, and how the runner's tests run them.

The scripts (``layers_towers.py``, ``slim_clones.py``, ``tensorpack_trainer.py``,
``keras_towers.py``, ``estimator_mirrored.py``, ``hand_moments.py``) know nothing of
tf1_syncbn; :mod:`unchanged.harness` runs them under ``python -m tf1_syncbn.run``
and under plain ``python`` (tests/run/). Each shows its style in full (model, tower or
clone loop, kept update ops, gradient combination); what shows none (arguments, data, the
session's steps and the saved variables) is in :mod:`unchanged.common`, as a user's own
utility module would be, and so is ``cifar10_multi_gpu_train.py``'s tower loop, which
``layers_towers.py``, ``hand_moments.py`` and ``already_patched.py`` share
(``unchanged.common.tower_gradients``).
"""
