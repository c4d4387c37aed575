"""Self-test: N synchronized towers == one device running fused batch norm.

Builds one :func:`tf1_syncbn.sync_batch_norm` layer on N towers (GPUs when
there are enough of them, else N virtual CPUs), feeds uneven per-tower batches
of random inputs and upstream gradients, runs one training step (forward,
backward, moving-average update) and compares with
``tf.compat.v1.nn.fused_batch_norm(..., is_training=True)`` on the
concatenated batch, on one device:

* the output and the input gradients (towers concatenated);
* the gamma and beta gradients (each tower differentiates its own loss, as a
  multi-tower training loop does; the sum over towers is compared);
* the moving mean and variance after one update, against
  ``(1 - decay) * batch_mean`` and ``decay * 1 + (1 - decay) * batch_var``
  (fused batch norm returns the Bessel-corrected batch variance).

Before running, it audits the graph it built (:func:`tf1_syncbn.audit_graph`:
the layer synchronized over every tower, its updates run by the training
step) and fails on any problem the audit reports; the report is printed.

It prints a table per backend, with the max abs error of each quantity and the
median time of a training step, and says PASS, FAIL or SKIPPED. Exit status:
0 when at least one backend ran and every backend that ran passed; 1 on a
mismatch or an error, and also when nothing was checked (every requested
backend was skipped, for example ``--backend nccl`` without GPUs), so that a
CI job cannot pass on a skip. Backends that cannot run here are skipped with
a message.

Usage::

    python -m tf1_syncbn.selftest [--towers N] [--backend collective|nccl|auto|all]
                                  [--device auto|cpu|gpu] [--steps K] [--seed S]
                                  [--group-size G] [--tf1-behavior]

``--group-size G``: sync groups of ``G`` towers, each against its own batch;
the moving statistics against the first group's (docs/sync-groups.md).

``--tf1-behavior`` runs the check under ``tf.compat.v1.disable_v2_behavior()``,
as TF1 scripts do (default: TF2-behaviour graph mode).
"""

import collections
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf1_syncbn._cli import SELFTEST_BACKENDS, selftest_parser  # noqa: E402
from tf1_syncbn.audit import audit_graph  # noqa: E402
from tf1_syncbn.backends import CollectiveBackend  # noqa: E402
from tf1_syncbn.slim import sync_batch_norm  # noqa: E402
from tower import call_for_each_tower, get_current_tower_context, virtual_cpu_config  # noqa: E402

__all__ = ['run_check', 'main', 'CheckResult', 'format_table', 'QUANTITIES', 'BACKENDS']

tf1 = tf.compat.v1

#: The backends the self-test knows, in the order of ``--backend all``.
BACKENDS = SELFTEST_BACKENDS

#: The compared quantities, in table order.
QUANTITIES = ('output', 'input_grad', 'gamma_grad', 'beta_grad', 'moving_mean',
              'moving_variance')

#: Per-tower batch sizes, cycled over the towers: uneven on purpose.
DEFAULT_BATCH_SIZES = (3, 5, 2, 4, 1, 6, 2, 3)

#: Per-example shape (NHWC without the batch).
DEFAULT_SHAPE = (4, 4, 8)

CheckResult = collections.namedtuple('CheckResult', [
    'backend', 'resolved', 'towers', 'devices', 'batch_sizes', 'errors', 'failed',
    'step_time', 'status', 'message', 'audit'], defaults=(None,))
CheckResult.__doc__ = """The outcome of :func:`run_check` for one backend.

Attributes:
  backend: the requested backend name.
  resolved: what it resolved to here (``'auto'`` -> ``'collective'``/``'nccl'``).
  towers: the number of towers.
  devices: the tower devices.
  batch_sizes: the per-tower batch sizes.
  errors: dict from each of :data:`QUANTITIES` to its max abs error (empty
    when skipped or when the run failed).
  failed: the quantities outside the tolerance.
  step_time: median seconds of one synchronized training step (or None).
  status: ``'PASS'``, ``'FAIL'`` or ``'SKIP'``.
  message: why a check was skipped or failed ('' on success).
  audit: the :func:`tf1_syncbn.audit_graph` report of the checked graph (None
    when skipped).
"""


def _gpu_count():
    return len(tf.config.list_physical_devices('GPU'))


def pick_devices(towers, device='auto'):
    """Chooses the tower devices and the session config.

    Args:
      towers: the number of towers.
      device: ``'gpu'`` (one GPU per tower), ``'cpu'`` (virtual CPUs) or
        ``'auto'`` (GPUs when there are at least ``towers`` of them, else
        virtual CPUs).

    Returns:
      ``(device_type, devices, config, note)``: ``'GPU'`` or ``'CPU'``, the
      device strings, a ``ConfigProto``, and a note for the user ('' if none).

    Raises:
      ValueError: on a bad argument, or ``device='gpu'`` with too few GPUs.
    """
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 1:
        raise ValueError('selftest: towers must be a positive int, got %r.' % (towers,))
    if device not in ('auto', 'cpu', 'gpu'):
        raise ValueError("selftest: device must be 'auto', 'cpu' or 'gpu', got %r." % (device,))
    gpus = _gpu_count() if device != 'cpu' else 0
    note = ''
    if device == 'gpu' and gpus < towers:
        raise ValueError('selftest: %d tower(s) on GPUs need %d GPU(s), found %d.'
                         % (towers, towers, gpus))
    if gpus >= towers:
        config = tf1.ConfigProto(allow_soft_placement=False)
        config.gpu_options.allow_growth = True
        return 'GPU', ['/gpu:%d' % i for i in range(towers)], config, note
    if gpus:
        note = ('%d GPU(s) for %d towers: using %d virtual CPUs instead (NCCL needs one GPU '
                'per tower).' % (gpus, towers, towers))
    return 'CPU', ['/cpu:%d' % i for i in range(towers)], virtual_cpu_config(towers), note


def _resolve(backend, device_type, towers):
    """The backend's ``sync_statistics`` value and its resolved name, or a skip reason."""
    if backend == 'collective':
        return CollectiveBackend(timeout=60), 'collective', ''
    if backend == 'nccl':
        if device_type != 'GPU':
            return None, 'nccl', 'NCCL needs one GPU per tower (no GPU tower here)'
        return 'nccl', 'nccl', ''
    if backend == 'auto':
        if towers == 1:
            return 'auto', 'none (1 tower)', ''
        return 'auto', 'nccl' if device_type == 'GPU' else 'collective', ''
    raise ValueError('selftest: unknown backend %r; use one of %s or all.'
                     % (backend, ', '.join(BACKENDS)))


def _batch_sizes(towers, batch_sizes):
    if batch_sizes is None:
        return [DEFAULT_BATCH_SIZES[i % len(DEFAULT_BATCH_SIZES)] for i in range(towers)]
    sizes = list(batch_sizes)
    if len(sizes) != towers or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                   for s in sizes):
        raise ValueError('selftest: batch_sizes must list %d non-negative ints, got %r.'
                         % (towers, batch_sizes))
    if sum(sizes) < 2:
        raise ValueError('selftest: the global batch needs at least 2 examples, got %r.'
                         % (sizes,))
    return sizes


def _build(spec, devices, shape, decay, epsilon, seed, perturb, group_size=None):
    """The synced towers (one sync_batch_norm each) and the fused reference."""
    towers = len(devices)
    xs, dys, ys, dxs, dgammas, dbetas = [], [], [], [], [], []

    def tower():
        i = get_current_tower_context().index
        x = tf1.placeholder(tf.float32, [None] + list(shape), name='x')
        dy = tf1.placeholder(tf.float32, [None] + list(shape), name='dy')
        y = sync_batch_norm(
            x, decay=decay, epsilon=epsilon, center=True, scale=True, sync_statistics=spec,
            scope='bn', group_size=group_size, param_initializers={
                'gamma': tf1.random_uniform_initializer(0.5, 1.5, seed=seed + 1),
                'beta': tf1.random_uniform_initializer(-1.0, 1.0, seed=seed + 2)})
        if perturb and i == towers - 1:
            # Injected mismatch (for testing the self-test): shift the last tower.
            y = y + perturb
        with tf1.variable_scope('bn', reuse=True):
            gamma = tf1.get_variable('gamma')
            beta = tf1.get_variable('beta')
        # Each tower differentiates its own loss, as in multi-tower training.
        dx, dgamma, dbeta = tf.gradients(tf.reduce_sum(y * dy), [x, gamma, beta])
        for store, value in ((xs, x), (dys, dy), (ys, y), (dxs, dx), (dgammas, dgamma),
                             (dbetas, dbeta)):
            store.append(value)

    call_for_each_tower(tower, devices)
    with tf1.variable_scope('bn', reuse=True):
        variables = {name: tf1.get_variable(name) for name in
                     ('gamma', 'beta', 'moving_mean', 'moving_variance')}
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(updates + dxs + dgammas + dbetas):
        step = tf.no_op(name='train_step')
    synced = dict(xs=xs, dys=dys, ys=ys, dxs=dxs, dgamma=tf.add_n(dgammas),
                  dbeta=tf.add_n(dbetas), step=step, variables=variables, updates=updates)

    with tf.device(devices[0]), tf1.name_scope('reference'):
        x = tf1.placeholder(tf.float32, [None] + list(shape), name='x')
        dy = tf1.placeholder(tf.float32, [None] + list(shape), name='dy')
        gamma = tf1.placeholder(tf.float32, [shape[-1]], name='gamma')
        beta = tf1.placeholder(tf.float32, [shape[-1]], name='beta')
        y, mean, variance = tf1.nn.fused_batch_norm(x, gamma, beta, epsilon=epsilon,
                                                    is_training=True)
        dx, dgamma, dbeta = tf.gradients(tf.reduce_sum(y * dy), [x, gamma, beta])
    reference = dict(x=x, dy=dy, gamma=gamma, beta=beta, y=y, mean=mean, variance=variance,
                     dx=dx, dgamma=dgamma, dbeta=dbeta)
    return synced, reference


def _errors(actual, expected, rtol, atol):
    """Max abs error of each quantity, and the ones outside ``atol + rtol * |expected|``."""
    errors, failed = {}, []
    for name in QUANTITIES:
        a = np.asarray(actual[name], np.float64)
        e = np.asarray(expected[name], np.float64)
        if a.shape != e.shape:
            errors[name] = float('inf')
            failed.append(name)
            continue
        diff = np.abs(a - e)
        errors[name] = float(diff.max()) if diff.size else 0.0
        if not np.all(diff <= atol + rtol * np.abs(e)):
            failed.append(name)
    return errors, failed


def run_check(backend, towers=4, batch_sizes=None, shape=DEFAULT_SHAPE, decay=0.9,
              epsilon=1e-3, steps=5, seed=0, perturb=0.0, device='auto', rtol=1e-4,
              atol=1e-4, group_size=None):
    """Runs the check for one backend and returns a :class:`CheckResult`.

    Builds its own graph and session, so it can be called several times in one
    process (with eager execution disabled, or not: everything is built inside
    ``tf.Graph().as_default()``).

    Args:
      backend: ``'collective'``, ``'nccl'`` or ``'auto'``.
      towers: the number of towers.
      batch_sizes: the per-tower batch sizes; default cycles 3, 5, 2, 4, 1, 6,
        2, 3.
      shape: the per-example shape, channels last.
      decay: the moving-average decay.
      epsilon: batch norm's epsilon.
      steps: timed training steps after the checked one (at least 1).
      seed: seeds the inputs and the gamma/beta initial values.
      perturb: added to the output of the last tower: a nonzero value injects a
        mismatch, to check that the self-test catches one.
      device: ``'auto'``, ``'cpu'`` or ``'gpu'``, see :func:`pick_devices`.
      rtol, atol: a quantity matches when ``|actual - expected| <= atol + rtol
        * |expected|`` element-wise.
      group_size: None, or sync groups of that many consecutive towers
        (dividing ``towers``), each against the reference on its own batch.

    Returns:
      A :class:`CheckResult`; ``status`` is ``'PASS'``, ``'FAIL'`` or ``'SKIP'``.

    Raises:
      ValueError: on an invalid argument.
    """
    if backend not in BACKENDS:
        raise ValueError('selftest: unknown backend %r; use one of %s.'
                         % (backend, ', '.join(BACKENDS)))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError('selftest: steps must be a positive int, got %r.' % (steps,))
    groups = _groups(towers, group_size)
    device_type, devices, config, _ = pick_devices(towers, device)
    sizes = _batch_sizes(towers, batch_sizes)
    spec, resolved, skip = _resolve(backend, device_type, towers)
    if skip:
        return CheckResult(backend, resolved, towers, devices, sizes, {}, [], None, 'SKIP', skip)

    rng = np.random.RandomState(seed)
    total = sum(sizes)
    x = (rng.randn(total, *shape) * 2.0 + rng.randn(shape[-1]) * 3.0).astype(np.float32)
    dy = rng.randn(total, *shape).astype(np.float32)
    bounds = np.cumsum([0] + sizes)
    parts = [(x[a:b], dy[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    graph = tf.Graph()
    with graph.as_default():
        synced, ref = _build(spec, devices, shape, decay, epsilon, seed, perturb, group_size)
        init = tf1.global_variables_initializer()
    report = audit_graph(graph, synced['step'])
    if not report.ok:
        return CheckResult(backend, resolved, towers, devices, sizes, {}, list(QUANTITIES),
                           None, 'FAIL', 'the graph audit found problems: %s'
                           % ' '.join(report.problems), report)
    feed = {}
    for ph_x, ph_dy, (px, pdy) in zip(synced['xs'], synced['dys'], parts):
        feed[ph_x] = px
        feed[ph_dy] = pdy
    fetches = [synced['ys'], synced['dxs'], synced['dgamma'], synced['dbeta'], synced['step']]
    try:
        with tf1.Session(graph=graph, config=config) as sess:
            sess.run(init)
            gamma, beta = sess.run([synced['variables']['gamma'], synced['variables']['beta']])
            ys, dxs, dgamma, dbeta, _ = sess.run(fetches, feed)
            moving_mean, moving_var = sess.run([synced['variables']['moving_mean'],
                                                synced['variables']['moving_variance']])
            expected = [sess.run(ref, {ref['x']: x[bounds[g[0]]:bounds[g[-1] + 1]],
                                       ref['dy']: dy[bounds[g[0]]:bounds[g[-1] + 1]],
                                       ref['gamma']: gamma, ref['beta']: beta})
                        for g in groups]
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                sess.run(synced['step'], feed)
                times.append(time.perf_counter() - start)
    except (tf.errors.OpError, ValueError, TypeError) as e:
        message = '%s: %s' % (type(e).__name__, str(e).strip().splitlines()[0])
        return CheckResult(backend, resolved, towers, devices, sizes, {}, list(QUANTITIES),
                           None, 'FAIL', message, report)

    actual = dict(output=np.concatenate(ys), input_grad=np.concatenate(dxs),
                  gamma_grad=dgamma, beta_grad=dbeta, moving_mean=moving_mean,
                  moving_variance=moving_var)
    # Each group against its own batch; the moving statistics follow tower 0's group.
    reference = dict(output=np.concatenate([e['y'] for e in expected]),
                     input_grad=np.concatenate([e['dx'] for e in expected]),
                     gamma_grad=np.sum([e['dgamma'] for e in expected], 0),
                     beta_grad=np.sum([e['dbeta'] for e in expected], 0),
                     moving_mean=(1.0 - decay) * expected[0]['mean'],
                     moving_variance=decay * 1.0 + (1.0 - decay) * expected[0]['variance'])
    errors, failed = _errors(actual, reference, rtol, atol)
    status = 'FAIL' if failed else 'PASS'
    message = ('mismatch in %s (tolerance %g abs + %g rel)' % (', '.join(failed), atol, rtol)
               if failed else '')
    return CheckResult(backend, resolved, towers, devices, sizes, errors, failed,
                       float(np.median(times)), status, message, report)


def _groups(towers, group_size):
    """The sync groups of ``towers`` (lists of consecutive tower indices).

    One tower is its own group, whatever ``group_size``, as in the layers.
    """
    if group_size is None:
        return [list(range(towers))]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or \
            (towers % group_size and towers > 1):
        raise ValueError('selftest: group_size must be a positive int that divides the %d '
                         'towers, got %r.' % (towers, group_size))
    if towers == 1:
        return [[0]]
    return [list(range(start, start + group_size)) for start in range(0, towers, group_size)]


def format_table(results):
    """Formats :class:`CheckResult` objects as a text table (one row per backend)."""
    short = {'output': 'output', 'input_grad': 'input_grad', 'gamma_grad': 'gamma_grad',
             'beta_grad': 'beta_grad', 'moving_mean': 'moving_mean',
             'moving_variance': 'moving_var'}
    header = ['backend', 'resolved'] + [short[q] for q in QUANTITIES] + ['step_ms', 'result']
    rows = []
    for r in results:
        if r.errors:
            cells = ['%.2e%s' % (r.errors[q], '*' if q in r.failed else '') for q in QUANTITIES]
        else:
            cells = ['-'] * len(QUANTITIES)
        step = '%.2f' % (r.step_time * 1e3) if r.step_time is not None else '-'
        rows.append([r.backend, r.resolved] + cells + [step, r.status])
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ['  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [header] + rows]
    lines.insert(1, '  '.join('-' * w for w in widths))
    for r in results:
        if r.message:
            lines.append('%s: %s' % (r.backend, r.message))
    return '\n'.join(lines)


def _parse(argv):
    parser = selftest_parser()
    args = parser.parse_args(argv)
    if args.towers is not None and args.towers < 1:
        parser.error('--towers must be at least 1')
    if args.steps < 1:
        parser.error('--steps must be at least 1')
    return args


def main(argv=None):
    """Runs the self-test; returns the exit status (0 pass; 1 mismatch, error or nothing run).

    Args:
      argv: the command-line arguments without the program name (default
        ``sys.argv[1:]``).
    """
    args = _parse(argv)
    if args.tf1_behavior:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    towers = args.towers
    if towers is None:
        gpus = _gpu_count() if args.device != 'cpu' else 0
        towers = gpus if gpus >= 2 else 4
    try:
        device_type, devices, _, note = pick_devices(towers, args.device)
    except ValueError as e:
        print('selftest: %s' % e, file=sys.stderr)
        return 1
    backends = BACKENDS if args.backend == 'all' else (args.backend,)
    sizes = _batch_sizes(towers, None)
    try:
        groups = _groups(towers, args.group_size)
    except ValueError as e:
        print('selftest: %s' % e, file=sys.stderr)
        return 1
    print('sync_batch_norm self-test: %d tower(s) on %s (%s), per-tower batches %s '
          '(%d examples), inputs [n, %s], vs tf.nn.fused_batch_norm on the concatenated '
          '%s. Errors: max abs; tolerance 1e-4 abs + 1e-4 rel.'
          % (towers, device_type, ', '.join(devices), sizes, sum(sizes),
             ', '.join(str(d) for d in DEFAULT_SHAPE),
             'batch' if len(groups) == 1 else "batch of each group's towers"))
    if len(groups) > 1:
        print('sync groups (group_size=%d): %s; the moving statistics follow group 1.'
              % (args.group_size, ' | '.join(
                  'group %d: towers %s' % (k + 1, ', '.join(map(str, g)))
                  for k, g in enumerate(groups))))
    if note:
        print('note: ' + note)
    if device_type == 'CPU':
        from tf1_syncbn import kernels  # noqa: PLC0415 - CPU runs only
        print('CPU kernels: ' + kernels.status())
    results = [run_check(b, towers=towers, steps=args.steps, seed=args.seed,
                         device=args.device, group_size=args.group_size) for b in backends]
    print(format_table(results))
    for r in results:
        if r.audit is not None:
            print('graph audit (%s):' % r.backend)
            print(r.audit)
    ran = [r for r in results if r.status != 'SKIP']
    failed = [r for r in ran if r.status == 'FAIL']
    if failed:
        print('FAIL: %s' % ', '.join(r.backend for r in failed))
        return 1
    if not ran:
        print('SKIPPED: no requested backend can run here; nothing was checked.')
        return 1
    print('PASS: %s%s' % (', '.join(r.backend for r in ran),
                          ' (skipped: %s)' % ', '.join(r.backend for r in results
                                                       if r.status == 'SKIP')
                          if len(ran) < len(results) else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main())
