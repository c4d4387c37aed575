"""``python -m tf1_syncbn.run``: unchanged TF1 scripts, synchronized, with proof before step 1.

::

    python -m tf1_syncbn.run [--num-dev N] [--group-size G] [--backend B] [--timeout S]
                             [--strict] [--report PATH] script.py [args...]   # or -m module
    TF1_SYNCBN_RUN='--num-dev 4 --strict' python script.py [args...]          # every process

The script runs as ``python script.py args`` would, with every batch norm it
builds through tf.layers, tf-slim, tensorpack or Keras 2 switched to this
library's layers (``sync_statistics='auto'``, tensorpack's too; ``--num-dev``
for ``tower_<i>`` / ``clone_<i>`` loops), and its graph audited at its first
training step: a report on stderr, a JSON file with ``--report``, and with
``--strict`` no step at all when a batch norm is not synchronized or its
moving statistics would not update. See docs/no-code-changes.md.

Where each part lives: :mod:`~tf1_syncbn.run.startup` (the options, the
start-up hook and the script, before TensorFlow loads: the standard library
only), :mod:`~tf1_syncbn.run.switches` (the patches, once TensorFlow is
imported), :mod:`~tf1_syncbn.run.proof` (the first training step's audit and
``--strict``), :mod:`~tf1_syncbn.run.report` (the report's text and JSON).

This ``__init__`` imports only :mod:`~tf1_syncbn.run.startup`: the package's
``--help`` and the start of ``python -m tf1_syncbn.run`` run before
TensorFlow is imported.
"""

from tf1_syncbn.run.startup import (BACKENDS, ENVIRONMENT_VARIABLE, STRICT_EXIT_STATUS,
                                    build_parser)

__all__ = ['ENVIRONMENT_VARIABLE', 'STRICT_EXIT_STATUS', 'BACKENDS', 'build_parser']
