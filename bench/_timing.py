"""Interleaved timing and the machine lines shared by the benchmark scripts."""

import os
import time

import numpy as np
from _machine import cpu_model, gpu_line


def median_times(runs, steps, warmup, block=5, between_rounds=None):
    """Median wall time (ms) of ``sess.run(fetch)`` for each named run.

    The runs take turns in blocks of ``block`` steps, so that drift in the
    machine's load affects all of them alike. The first step of each block is
    not timed: it pays for the caches the previous run evicted.

    Args:
      runs: dict name -> (session, fetch).
      steps: timed steps per run (rounded up to whole blocks).
      warmup: untimed steps per run first.
      block: consecutive steps per turn.
      between_rounds: None, or a callable run after every round of turns that
        returns ``{name: [seconds, ...]}`` timed elsewhere (another process
        taking its turn), merged into the result.
    """
    for sess, fetch in runs.values():
        for _ in range(warmup):
            sess.run(fetch)
    times = {name: [] for name in runs}
    while min(len(t) for t in times.values()) < steps:
        for name, (sess, fetch) in runs.items():
            sess.run(fetch)
            for _ in range(block):
                start = time.perf_counter()
                sess.run(fetch)
                times[name].append(time.perf_counter() - start)
        if between_rounds is not None:
            for name, values in between_rounds().items():
                times.setdefault(name, []).extend(values)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def machine_line():
    """One line naming the machine the figures come from, and its load."""
    import tensorflow as tf  # noqa: PLC0415 - scripts set TF's log level first
    try:
        load = ', load average %.2f' % os.getloadavg()[0]
    except OSError:
        load = ''
    return 'machine: %s, %d cores, TensorFlow %s%s' % (cpu_model(), os.cpu_count(),
                                                       tf.__version__, load)


def setup_lines(setup, backend=None):
    """What the figures ran on: :func:`machine_line`; on GPU towers the GPUs and how
    they were split; with a ``backend``, the kernels and the sync backend.

    Args:
      setup: the ``_devices.TowerSetup`` of the towers.
      backend: the layers' sync backend, or None (no kernels line).
    """
    lines = [machine_line()]
    if setup.kind == 'gpu':
        lines += [gpu_line()] + ['note: ' + note for note in setup.notes]
    if backend is not None:
        from tf1_syncbn import kernels  # noqa: PLC0415 - scripts set TF's log level first
        lines.append('kernels: %s; sync backend: %r' % (
            "GPU towers: TensorFlow's kernels" if setup.kind == 'gpu' else kernels.status(),
            backend))
    return lines
