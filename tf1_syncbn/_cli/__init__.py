"""The commands' parsers and what runs before TensorFlow loads (the standard library only).

* :mod:`~tf1_syncbn._cli.parsers`: the parsers of ``python -m tf1_syncbn.audit``,
  ``.selftest`` and ``.kernels`` (the launcher's and the runner's, loaded by name);
* :mod:`~tf1_syncbn._cli.early`: :func:`answer_help_early` (a command's ``--help``
  before the package imports TensorFlow) and :func:`start_early` (``python -m
  tf1_syncbn.run``'s script, started before it too).
"""

from tf1_syncbn._cli.early import answer_help_early, start_early
from tf1_syncbn._cli.parsers import (SELFTEST_BACKENDS, audit_parser, kernels_parser,
                                     selftest_parser)

__all__ = ['answer_help_early', 'start_early', 'audit_parser', 'selftest_parser',
           'kernels_parser', 'SELFTEST_BACKENDS']
