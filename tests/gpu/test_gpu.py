"""GPU-only: synchronized towers on GPUs against float64 numpy references (bn_reference.py).

**Run this file in a process of its own** on a machine with GPUs, once per
TF behaviour (``make gpu-check`` does both, and more)::

    TF1_SYNCBN_TEST_BEHAVIOR=v2 python -m pytest -q tests/gpu/test_gpu.py
    TF1_SYNCBN_TEST_BEHAVIOR=v1 python -m pytest -q tests/gpu/test_gpu.py

The synchronized cases want 3 GPU devices (uneven towers, one empty). With
fewer physical GPUs (one, as on many GPU machines), each is split into
logical GPUs (``bench/_devices.py``: the process's
``tf.config.set_logical_device_configuration`` and the sessions'
``gpu_options.experimental.virtual_devices``), so that the GPU-collective
path (:class:`tf1_syncbn.CollectiveBackend`) and the kernel set GPU towers
run (cuDNN fused kernels, the vector math through XLA) are checked on one
GPU. TensorFlow fixes a process's GPU devices when it first initializes them,
so the split happens only when this file is the only one in the pytest run
(in ``make test`` other files' sessions initialize the GPUs first) and the
GPUs are not initialized yet; otherwise the cases that need more GPU devices
than there are physical GPUs skip, saying why. NCCL needs distinct physical
GPUs: its cases skip on one.

The cases (each against numpy, in both TF behaviours):

* both backends, float32/float16/bfloat16, NHWC and NCHW (the two layouts
  the GPU kernel set handles differently): outputs and input gradients;
* a tensor ``is_training``: training output, the moving statistics after one
  update, then the inference output from them;
* renorm (the slow path: separate differentiable ops) with clipping active
  on some channels: outputs and the input, gamma and beta gradients.

Without GPUs every case skips with the reason, and the file costs one
``tf.config.list_physical_devices`` call. ``TF1_SYNCBN_GPU_TESTS_ON_CPU=1``
dry-runs the same cases on virtual CPUs with TensorFlow's stock kernels (the
CPU stand-in of the GPU kernel set; NCCL cases skip), which checks the test
code itself on a machine without GPUs (``tests/gpu/test_gpu_check.py`` does).
"""

import collections
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward, build_towers_on, split_batches
from tf1_syncbn import CollectiveBackend, NcclBackend, kernels, sync_batch_norm
from tower import virtual_cpu_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'bench'))
import _devices  # noqa: E402
import _machine  # noqa: E402

tf1 = tf.compat.v1
#: The environment variable of the dry run on virtual CPUs.
ON_CPU_VARIABLE = 'TF1_SYNCBN_GPU_TESTS_ON_CPU'
ON_CPU = os.environ.get(ON_CPU_VARIABLE) == '1'
PHYSICAL = 0 if ON_CPU else len(tf.config.list_physical_devices('GPU'))
pytestmark = pytest.mark.skipif(
    not PHYSICAL and not ON_CPU,
    reason='GPU-only: TensorFlow sees no GPU here (make gpu-check runs these on a GPU machine)')

#: Towers of the synchronized cases: uneven, one empty.
SIZES = (3, 0, 5)
#: Memory of each logical GPU at most (MiB): these graphs are small.
MEMORY_CAP_MB = 2048
EPS = 1e-3
DECAY = 0.9
TOLERANCE = {tf.float32: 1e-4, tf.float16: 1e-2, tf.bfloat16: 6e-2}

#: ``collective``: the devices of the collective cases; ``nccl``: one device
#: per physical GPU; ``config``: the session config; ``why``: why there are
#: fewer than ``len(SIZES)`` collective devices ('' otherwise).
Layout = collections.namedtuple('Layout', ['collective', 'nccl', 'config', 'why'])


def _other_files(session):
    """The other test files of this pytest run."""
    here = os.path.abspath(__file__)
    return sorted({os.path.basename(str(getattr(item, 'path', None) or item.fspath))
                   for item in session.items
                   if os.path.abspath(str(getattr(item, 'path', None) or item.fspath)) != here})


def plan_layout(physical, other_files):
    """How many logical GPUs per physical GPU, and why not more: ``(split, why)``."""
    split = _devices.split_factor(len(SIZES), physical)
    if split > 1 and other_files:
        return 1, ('%d physical GPU(s), not split into logical GPUs: other test files run in '
                   'this process (%s), whose sessions initialize the GPUs first. Run '
                   'tests/gpu/test_gpu.py in its own process (make gpu-check does)'
                   % (physical, ', '.join(other_files[:3]) +
                      (', ...' if len(other_files) > 3 else '')))
    return split, ''


@pytest.fixture(scope='module')
def layout(request):
    """The GPU devices of this process, split into logical GPUs where needed and possible."""
    if ON_CPU:
        with kernels.use_custom_kernels(False):     # the CPU stand-in of the GPU kernel set
            yield Layout(['/cpu:%d' % i for i in range(len(SIZES))], [],
                         virtual_cpu_config(len(SIZES)), '')
        return
    split, why = plan_layout(PHYSICAL, _other_files(request.session))
    memory_mb = None
    if split > 1:
        free = [g.memory_free_mb for g in _machine.query_gpus() or []
                if g.memory_free_mb is not None]
        memory_mb = _devices.logical_memory_mb(split, MEMORY_CAP_MB, min(free) if free else None)
        try:
            _devices.split_physical_gpus(split, memory_mb)
        except ValueError as e:
            split, why = 1, '%d physical GPU(s): %s' % (PHYSICAL, e)
    towers = min(len(SIZES), PHYSICAL * split)
    yield Layout(['/gpu:%d' % i for i in _devices.tower_gpus(towers, PHYSICAL, split)],
                 ['/gpu:%d' % (p * split) for p in range(PHYSICAL)],
                 _devices.gpu_session_config(PHYSICAL, split, memory_mb), why)


def _devices_for(layout, backend):
    """The tower devices and per-tower batch sizes for ``backend``, or a skip."""
    if backend == 'nccl':
        if ON_CPU:
            pytest.skip('NCCL needs GPUs: not part of the dry run on CPUs')
        if len(layout.nccl) < 2:
            pytest.skip('NCCL needs 2 distinct physical GPUs (its communicators refuse two '
                        'logical GPUs of one physical GPU); found %d' % len(layout.nccl))
        devices = layout.nccl[:len(SIZES)]
    else:
        if len(layout.collective) < 2:
            pytest.skip('needs 2 GPU devices, has 1: ' + layout.why)
        devices = layout.collective
    sizes = list(SIZES) if len(devices) == len(SIZES) else [3, 5]
    return devices, sizes


def _backend(name):
    return NcclBackend() if name == 'nccl' else CollectiveBackend(timeout=120)


def _session(graph, layout):
    return tf1.Session(graph=graph, config=layout.config)


def _data(rng, n, data_format, channels=3, scale=2.0, shift=1.0):
    """``x`` and ``dy`` of ``n`` examples, 4x4 with ``channels`` channels, in ``data_format``."""
    shape = (n, 4, 4, channels) if data_format == 'NHWC' else (n, channels, 4, 4)
    x = (rng.randn(*shape) * scale + shift).astype(np.float32)
    return x, rng.randn(*shape).astype(np.float32)


def _shape(data_format, channels=3):
    return (None, 4, 4, channels) if data_format == 'NHWC' else (None, channels, 4, 4)


def _feed(net, x, dy, sizes):
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    return feed


def _close(actual, expected, tol, what):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol,
                               err_msg=what)


@pytest.mark.parametrize('data_format', ['NHWC', 'NCHW'])
@pytest.mark.parametrize('dtype', [tf.float32, tf.float16, tf.bfloat16],
                         ids=['float32', 'float16', 'bfloat16'])
@pytest.mark.parametrize('backend', ['nccl', 'collective'])
def test_gpu_towers_equal_the_global_batch(graph, rng, layout, backend, dtype, data_format):
    devices, sizes = _devices_for(layout, backend)
    net = build_towers_on(lambda x: sync_batch_norm(x, epsilon=EPS, data_format=data_format,
                                                    sync_statistics=_backend(backend)),
                          devices, _shape(data_format), dtype)
    grads = tf.gradients(net['loss'], net['xs'])
    x, dy = _data(rng, sum(sizes), data_format)
    with _session(graph, layout) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, dxs = sess.run([net['ys'], grads], _feed(net, x, dy, sizes))
    xr = x.astype(dtype.as_numpy_dtype).astype(np.float64)
    last = data_format == 'NHWC'
    tol = TOLERANCE[dtype]
    _close(np.concatenate(ys).astype(np.float64),
           bn_forward(xr, 1, 0, EPS, channels_last=last)['y'], tol, 'output')
    _close(np.concatenate(dxs), bn_backward(dy, xr, np.ones(3), EPS, channels_last=last)['dx'],
           tol, 'input gradient')


@pytest.mark.parametrize('data_format', ['NHWC', 'NCHW'])
def test_tensor_is_training_and_the_moving_statistics(graph, rng, layout, data_format):
    """Training (fed True), one moving-average update, then inference (fed False)."""
    devices, sizes = _devices_for(layout, 'collective')
    training = tf1.placeholder(tf.bool, [], name='training')
    net = build_towers_on(lambda x: sync_batch_norm(
        x, decay=DECAY, epsilon=EPS, data_format=data_format, is_training=training,
        scope='bn', sync_statistics=_backend('collective')), devices, _shape(data_format))
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    moving = [_variable('bn/moving_mean'), _variable('bn/moving_variance')]
    x, dy = _data(rng, sum(sizes), data_format)
    feed = _feed(net, x, dy, sizes)
    last = data_format == 'NHWC'
    with _session(graph, layout) as sess:
        sess.run(tf1.global_variables_initializer())
        feed[training] = True
        ys, _ = sess.run([net['ys'], updates], feed)
        mean, variance = sess.run(moving)
        feed[training] = False
        inferred = sess.run(net['ys'], feed)
    ref = bn_forward(x, 1, 0, EPS, channels_last=last)
    _close(np.concatenate(ys), ref['y'], 1e-4, 'training output')
    # The fused path tracks the Bessel-corrected variance of the global batch (as slim).
    _close(mean, (1 - DECAY) * ref['mean'], 1e-5, 'moving mean')
    _close(variance, DECAY + (1 - DECAY) * ref['var_unbiased'], 1e-5, 'moving variance')
    shape = (1, 1, 1, 3) if last else (1, 3, 1, 1)
    expected = (x - mean.reshape(shape)) / np.sqrt(variance.reshape(shape) + EPS)
    _close(np.concatenate(inferred), expected, 1e-4, 'inference output')


def _variable(name):
    found = [v for v in tf1.global_variables() if v.op.name == name]
    assert len(found) == 1, (name, [v.op.name for v in tf1.global_variables()])
    return found[0]


@pytest.mark.parametrize('data_format', ['NHWC', 'NCHW'])
def test_renorm_slow_path(graph, rng, layout, data_format):
    """Batch renormalization at its first step: ``r``, ``d`` from the initial renorm statistics.

    ``renorm_mean`` starts at 0 and ``renorm_stddev`` at 1, so ``r`` is the
    batch's standard deviation and ``d`` its mean, clipped: the data's
    channels put ``r`` below ``rmin``, inside, above ``rmax``, and ``d``
    inside and above ``dmax``. ``r`` and ``d`` carry no gradient.
    """
    clipping = {'rmin': 0.8, 'rmax': 1.5, 'dmax': 0.3}
    devices, sizes = _devices_for(layout, 'collective')
    net = build_towers_on(lambda x: sync_batch_norm(
        x, epsilon=EPS, scale=True, data_format=data_format, renorm=True,
        renorm_clipping=clipping, scope='bn', sync_statistics=_backend('collective')),
        devices, _shape(data_format))
    gamma, beta = _variable('bn/gamma'), _variable('bn/beta')
    grads = tf.gradients(net['loss'], net['xs'] + [gamma, beta])
    last = data_format == 'NHWC'
    x, dy = _data(rng, sum(sizes), data_format,
                  scale=np.array([0.5, 1.0, 3.0]).reshape((3,) if last else (3, 1, 1)),
                  shift=np.array([0.1, -0.2, 2.0]).reshape((3,) if last else (3, 1, 1)))
    with _session(graph, layout) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, values = sess.run([net['ys'], grads], _feed(net, x, dy, sizes))
    dxs, dgamma, dbeta = values[:-2], values[-2], values[-1]
    ref = bn_forward(x, 1, 0, EPS, channels_last=last)
    r = np.clip(np.sqrt(ref['var'] + EPS), clipping['rmin'], clipping['rmax'])
    d = np.clip(ref['mean'], -clipping['dmax'], clipping['dmax'])
    assert (r == clipping['rmin']).any() and (r == clipping['rmax']).any() and \
        (d == clipping['dmax']).any() and (np.abs(d) < clipping['dmax']).any()
    xhat_r_d = ref['xhat'] * r + d                      # channels last
    dyl = dy if last else np.moveaxis(dy, 1, -1)
    expected_y = xhat_r_d if last else np.moveaxis(xhat_r_d, -1, 1)
    _close(np.concatenate(ys), expected_y, 1e-4, 'output')
    _close(np.concatenate(dxs), bn_backward(dy, x, r, EPS, channels_last=last)['dx'], 1e-4,
           'input gradient')
    _close(dgamma, (dyl * xhat_r_d).reshape(-1, 3).sum(0), 1e-3, 'gamma gradient')
    _close(dbeta, dyl.reshape(-1, 3).sum(0), 1e-3, 'beta gradient')
