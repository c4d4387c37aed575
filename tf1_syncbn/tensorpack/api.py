"""tensorpack's layer API for :func:`BatchNorm` and :func:`BatchRenorm`.

Two things make this library's tensorpack-style layers work inside existing
tensorpack code:

* **argscope.** The layers accept tensorpack's ``argscope``, as tensorpack's
  own layers do: ``with argscope([Conv2D, BatchNorm], data_format='NCHW')``.
  An argscope is keyed by the layer's name, so one set for tensorpack's
  ``BatchNorm`` applies to this one too. Explicit arguments win over the
  argscope, which wins over :func:`patch_tensorpack`'s defaults.
* **patch_tensorpack()** (:mod:`tf1_syncbn.tensorpack.patch`). One call that
  makes code written for tensorpack's ``BatchNorm`` / ``BatchRenorm`` build
  these instead, with no other edit: calls by imported name, through
  ``argscope`` and through ``LinearWrap``. It sets the defaults kept here.

tensorpack is never imported unless :func:`patch_tensorpack` is called: the
argscope is read only when the user's program has imported tensorpack.
"""

import functools
import sys
import threading

__all__ = ['tensorpack_layer']

#: The layers' names (tensorpack keys argscopes and its layer registry by them).
_LAYER_NAMES = ('BatchNorm', 'BatchRenorm')
_DEFAULTS = {}          # layer name -> default keyword arguments of the active patches
_LAYERS = {}            # layer name -> this library's layer, as @tensorpack_layer wrapped it
_LOCK = threading.Lock()


def _argscope_kwargs(name):
    module = sys.modules.get('tensorpack.tfutils.argscope')
    if module is None:
        return {}
    return dict(module.get_arg_scope()[name])


def tensorpack_layer(func):
    """Gives a tensorpack-style layer ``func(name, inputs, ...)`` tensorpack's layer API.

    The wrapped layer reads tensorpack's ``argscope`` (when tensorpack is
    imported) and the defaults of an active :func:`patch_tensorpack`, and has
    the attributes that tensorpack's ``argscope`` and ``LinearWrap`` look for
    (``__argscope_enabled__``, ``use_scope``).
    """
    @functools.wraps(func)
    def layer(*args, **kwargs):
        with _LOCK:
            merged = dict(_DEFAULTS.get(func.__name__, {}))
        merged.update(_argscope_kwargs(func.__name__))
        merged.update(kwargs)
        return func(*args, **merged)

    layer.__argscope_enabled__ = True
    layer.use_scope = True
    _LAYERS[func.__name__] = layer
    return layer
