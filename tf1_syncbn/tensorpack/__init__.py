"""The tensorpack front-end: ``BatchNorm`` and ``BatchRenorm``, synchronized, and the switch.

* :func:`BatchNorm`, :func:`BatchRenorm`, :func:`start_finetuning`
  (:mod:`~tf1_syncbn.tensorpack.layer`): tensorpack's signatures, variable
  names and rules, plus ``sync_statistics``;
* :mod:`~tf1_syncbn.tensorpack.rules`: tensorpack's rules for them: where
  their arguments come from (``argscope``, a patch's defaults, the old
  names), the values they take, when its layer runs the fused kernel;
* :func:`patch_tensorpack` (:mod:`~tf1_syncbn.tensorpack.patch`): code
  written for tensorpack's layers builds these, unedited.

Also ``tf1_syncbn.BatchNorm``, ``tf1_syncbn.BatchRenorm``,
``tf1_syncbn.start_finetuning``, ``tf1_syncbn.patch_tensorpack``.
"""

from tf1_syncbn.tensorpack.layer import BatchNorm, BatchRenorm, start_finetuning
from tf1_syncbn.tensorpack.patch import patch_tensorpack

__all__ = ['BatchNorm', 'BatchRenorm', 'start_finetuning', 'patch_tensorpack']
