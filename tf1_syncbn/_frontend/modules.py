"""The loaded modules' namespaces, read without running any module's attribute hooks.

The patches (:func:`tf1_syncbn.patch_tensorpack`,
:func:`tf1_syncbn.patch_tf_layers`, :func:`tf1_syncbn.keras.patch_keras`)
replace a library's objects under every name a loaded module holds them by,
found by identity. They read each module's ``__dict__`` directly: TensorFlow's
lazy loaders import what they stand for on any attribute access, and some
proxies raise on it.
"""

import sys

__all__ = ['namespace', 'loaded_modules']


def namespace(value):
    """``value.__dict__`` as a dict, or None (lazy loaders and proxies are not touched)."""
    try:
        found = object.__getattribute__(value, '__dict__')
    except Exception:  # noqa: BLE001 - no namespace to look into, whatever the reason
        return None
    return found if isinstance(found, dict) else None


def loaded_modules():
    """``(name, module)`` for every loaded module with a namespace.

    A TensorFlow module wrapper (``_tfmw_wrapped_module``) comes with the
    module it wraps, under the wrapper's name: code holds names in either.
    """
    for key, module in list(sys.modules.items()):
        space = namespace(module)
        if space is None:
            continue
        name = space.get('__name__', key)
        if not isinstance(name, str):
            name = key
        yield name, module
        wrapped = space.get('_tfmw_wrapped_module')
        if wrapped is not None and namespace(wrapped) is not None:
            yield name, wrapped
