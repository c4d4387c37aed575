"""Tests that run the Horovod backend under ``horovodrun --gloo`` (``make test-horovod``).

A package, so that its ``conftest.py`` and modules do not shadow ``tests/``'s
(``from conftest import make_session``). The worker scripts run as scripts
and import nothing from here but themselves and ``tests/``'s helpers.
"""
