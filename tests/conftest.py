"""Shared fixtures: TF1 graph mode and virtual CPU devices."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()

from tower import virtual_cpu_config  # noqa: E402

MAX_DEVICES = 8


@pytest.fixture
def graph():
    """A fresh default graph for the test."""
    g = tf.Graph()
    with g.as_default():
        yield g


def make_session(graph, num_devices=MAX_DEVICES):
    """A session on ``graph`` with ``num_devices`` virtual CPUs."""
    return tf.compat.v1.Session(graph=graph, config=virtual_cpu_config(num_devices))


@pytest.fixture
def rng():
    return np.random.RandomState(1234)


@pytest.fixture(params=['custom', 'stock'])
def kernel_impl(request):
    """Runs a test once with the compiled CPU kernels and once with TF's stock kernels."""
    from tf1_syncbn import kernels
    with kernels.use_custom_kernels(request.param == 'custom'):
        if request.param == 'custom':
            assert kernels.load() is not None, kernels.status()
        yield request.param
