"""The supported TensorFlow range: declared once in pyproject.toml, tested on each version.

``pyproject.toml``'s ``cpu`` and ``gpu`` extras declare the range; the
Makefile's ``TF_VERSIONS`` (``make test-tf<version>``) must be exactly its
minor versions, each with a pinned ``tensorflow-cpu`` of that minor; the
TensorFlow this run imports must be in the range (so a version environment
that installed another TensorFlow fails here).
"""

import os
import re
import tomllib

import pytest
import tensorflow as tf
from packaging.specifiers import SpecifierSet
from packaging.version import Version

pytestmark = [pytest.mark.versions, pytest.mark.once]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _declared():
    with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
        extras = tomllib.load(f)['project']['optional-dependencies']
    ranges = {}
    for extra, package in (('cpu', 'tensorflow-cpu'), ('gpu', 'tensorflow[and-cuda]')):
        (requirement,) = extras[extra]
        assert requirement.startswith(package), requirement
        ranges[extra] = SpecifierSet(requirement[len(package):])
    assert ranges['cpu'] == ranges['gpu'], ranges
    return ranges['cpu']


def _makefile():
    with open(os.path.join(ROOT, 'Makefile')) as f:
        text = f.read()
    versions = re.search(r'^TF_VERSIONS\s*:=\s*(.+)$', text, re.M).group(1).split()
    pins = dict(re.findall(r'^TF_PINS_(\S+)\s*:=\s*tensorflow-cpu==(\S+)', text, re.M))
    return versions, pins


def test_the_makefile_tests_every_minor_version_of_the_declared_range():
    declared = _declared()
    versions, pins = _makefile()
    minors = ['2.%d' % minor for minor in range(0, 40) if Version('2.%d.0' % minor) in declared]
    assert versions == minors, (versions, str(declared))
    for version in versions:
        assert pins.get(version, '').startswith(version + '.'), (version, pins)
        assert Version(pins[version]) in declared, (version, pins[version])


def test_this_tensorflow_is_in_the_declared_range():
    assert Version(tf.__version__) in _declared(), tf.__version__
