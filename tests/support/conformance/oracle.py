"""The oracle: the replaced layer on one device with each sync group's concatenated batch.

For a cell (front-end, option, groups), the replaced layer (tf-slim 1.1,
tensorpack 0.11, tf-keras' legacy tf.layers, tf-keras, ``tf.nn.moments``)
runs once per group, on that group's towers' rows concatenated (in the
order the replaced layer's ghost batches need), one training step with
the upstream gradients of the cell's data. Its arrays are keyed as
``run.py`` keys the cell's:

* ``y/0``, ``dx/0``: each tower's rows from its group's run, at their rows
  of the global batch (``y/mean``, ``y/variance``: each tower's group's
  statistics, for ``moments``);
* ``grad/0/<variable>``: summed over the groups (every tower's gradient of
  a shared variable adds up);
* ``var/``, ``saved/``, ``restored/<variable>``: after the step, those of
  **global tower 0's group** (docs/sync-groups.md): the values every
  harness must read back, save and restore;
* ``mean/<variable>``: the mean over the towers of each tower's group's
  values: what tf-keras' own layer reads, saves and restores under a
  ``tf.distribute`` strategy, which keeps each replica's copy of a moving
  statistic and averages them on read (``matrix.Outcome.replica_mean``).

Every reference of a test run is computed in one subprocess with legacy
Keras (``legacy_reference.run_reference``: a fork of an interpreter that
has imported TensorFlow), one graph per option, in the test's TF
behaviour. Nothing here imports ``tf1_syncbn``.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

from conformance import front_ends as fes
from conformance import options as opts

tf1 = tf.compat.v1

SCRIPT = '''
import sys
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from conformance import oracle
oracle.main(sys.argv[1], sys.argv[2])
print('RESULT', sys.argv[2])
'''


def request_key(front_end, option, groups):
    """The name of one reference: ``front-end|option|groups``."""
    return '%s|%s|%s' % (front_end.name, option.name,
                         '/'.join(','.join(str(t) for t in group) for group in groups))


def compute(requests, tmp_path):
    """Every reference of ``requests`` (``(front-end, option, groups)`` each), in one subprocess.

    Returns:
      ``{request_key: {array key: array}}``; a request whose reference failed
      maps to ``{'error': message}``.
    """
    from legacy_reference import run_reference  # noqa: PLC0415 - the test process's side
    wanted = {}
    for front_end, option, groups in requests:
        wanted[request_key(front_end, option, groups)] = [front_end.name, option.name,
                                                          [list(g) for g in groups]]
    path = os.path.join(str(tmp_path), 'requests.json')
    with open(path, 'w') as f:
        json.dump(wanted, f)
    out = os.path.join(str(tmp_path), 'oracle.npz')
    run_reference(SCRIPT, tmp_path, args=[path, out], timeout=900)
    return load(out)


def load(path):
    """The references written by :func:`main` at ``path``."""
    loaded = np.load(path)
    with open(path + '.json') as f:
        errors = json.load(f)
    references = {key: {'error': message} for key, message in errors.items()}
    for name in loaded.files:
        key, array = name.split('#', 1)
        references.setdefault(key, {})[array] = loaded[name]
    return references


def _relative(variable, scope):
    parts = variable.op.name.split('/')
    return '/'.join(parts[parts.index(scope) + 1:])


def _build_group(front_end, option, members, data, training, index, g):
    """The replaced layer on one group's batch: its tensors and what to feed."""
    rows = front_end.reference_rows(option, members)
    shape = (None,) + option.shape[1:]
    x = tf1.placeholder(tf.float32, shape, 'x')
    dy = tf1.placeholder(tf.float32, shape, 'dy')
    weights = tf1.placeholder(tf.float32, [None], 'weights')
    created = []
    scope = 'g%d' % g
    before = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
    with front_end.replaced_context(), tf1.variable_scope('r%d' % index), \
            tf1.variable_scope(scope), fes.recording(created):
        outputs = front_end.build_replaced(tf.cast(x, option.dtype),
                                           training if option.training_tensor else True, option,
                                           weights=weights)
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[before:]
    trainable = [v for v in created if v.trainable]
    loss = tf.reduce_sum(tf.cast(outputs['y'], tf.float32) * dy)
    grads = tf.gradients(loss, [x] + trainable)
    grads = [tf.zeros_like(v) if gr is None else tf.convert_to_tensor(gr)
             for gr, v in zip(grads, [x] + trainable)]
    fetches = {'outputs': outputs, 'dx': grads[0],
               'grads': {_relative(v, scope): gr for v, gr in zip(trainable, grads[1:])}}
    feed = {x: data['x'][rows], dy: data['dy'][rows], weights: data['weights'][rows]}
    variables = {_relative(v, scope): v for v in created}
    return rows, fetches, feed, updates, variables


def _references(option, requests):
    """One graph with every request of ``option``; returns ``{key: arrays}``."""
    data = opts.option_data(option)
    towers = opts.tower_rows(option.sizes)
    graph = tf.Graph()
    built = {}
    errors = {}
    with graph.as_default():
        training = tf1.placeholder(tf.bool, [], 'training')
        for index, (key, (front_end, groups)) in enumerate(sorted(requests.items())):
            try:
                built[key] = [(members,) + _build_group(front_end, option, members, data,
                                                         training, index, g)
                              for g, members in enumerate(groups)]
            except Exception as e:  # noqa: BLE001 - reported by the cells that need it
                errors[key] = '%s: %s' % (type(e).__name__, str(e)[:2000])
        init = tf1.global_variables_initializer()
    feed = {training: True}
    for parts in built.values():
        for part in parts:
            feed.update(part[3])
    with tf1.Session(graph=graph) as sess:
        sess.run(init)
        step = {key: [part[2] for part in parts] for key, parts in built.items()}
        updates = [u for parts in built.values() for part in parts for u in part[4]]
        # One device and the same feed: the updates may run after the step's fetches, in
        # a run of their own, which no read of the step can race in TF1 behaviour.
        values = sess.run(step, feed)
        sess.run(updates, feed)
        read = sess.run({key: [part[5] for part in parts] for key, parts in built.items()})
    arrays = {}
    for key, parts in built.items():
        front_end = requests[key][0]
        out = arrays[key] = {}
        y = np.zeros(option.shape, np.float32)
        dx = np.zeros(option.shape, np.float32)
        stats = {name: [None] * len(towers) for name in front_end.outputs if name != 'y'}
        for (members, rows, *_), value in zip(parts, values[key]):
            y[rows] = np.asarray(value['outputs']['y'], np.float32)
            dx[rows] = value['dx']
            for name in stats:
                for t in members:
                    stats[name][t] = np.asarray(value['outputs'][name], np.float32)
            for rel, grad in value['grads'].items():
                out['grad/0/' + rel] = out.get('grad/0/' + rel, 0) + grad
        out['y/0'], out['dx/0'] = y, dx
        for name, per_tower in stats.items():
            out['y/' + name] = np.stack(per_tower)
        main = next(g for g, part in enumerate(parts) if 0 in part[0])
        for rel, value in read[key][main].items():
            for kind in ('var', 'saved', 'restored'):
                out['%s/%s' % (kind, rel)] = value
            out['mean/' + rel] = np.mean(
                [np.asarray(read[key][g][rel], np.float64)
                 for g, part in enumerate(parts) for _ in part[0]], axis=0)
    return arrays, errors


def main(requests_path, out_path):
    """Computes every reference of a requests file (the subprocess's side)."""
    with open(requests_path) as f:
        wanted = json.load(f)
    by_option = {}
    for key, (front_end, option, groups) in wanted.items():
        by_option.setdefault(option, {})[key] = (fes.BY_NAME[front_end],
                                                 tuple(tuple(g) for g in groups))
    flat, errors = {}, {}
    for option, requests in sorted(by_option.items()):
        try:
            arrays, failed = _references(opts.BY_NAME[option], requests)
        except Exception as e:  # noqa: BLE001 - reported by the cells that need it
            arrays, failed = {}, {key: '%s: %s' % (type(e).__name__, str(e)[:2000])
                                  for key in requests}
        errors.update(failed)
        for key, out in arrays.items():
            flat.update({'%s#%s' % (key, name): value for name, value in out.items()})
    np.savez(out_path, **flat)
    with open(out_path + '.json', 'w') as f:
        json.dump(errors, f)


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
