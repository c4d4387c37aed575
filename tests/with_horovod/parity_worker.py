"""One process of the Horovod parity job: every run of ``horovod_cases`` on this process's towers.

    horovodrun -np 2 -H localhost:2 --gloo python parity_worker.py OUT_DIR [NAME_FILTER]

``OUT_DIR/job.json`` (``horovod_cases.write_job``) lists the cases, the runs
and the source of the layer functions. For each run (a case and a layout),
every process builds its towers of the case's layer from this library with
``sync_statistics='horovod'`` (one tower: no tower context, Horovod's
one-tower-per-process convention; several: ``tower.TowerContext`` on
virtual CPUs), trains ``parity_harness.STEPS`` SGD
steps on its rows of the same global batches as the reference, with the
parameter gradients summed across processes by ``hvd.allreduce`` (as
``hvd.DistributedOptimizer(op=hvd.Sum)`` does) and the variables broadcast
from rank 0 first, and records what ``parity_harness.train_case`` records.
Writes ``OUT_DIR/rank<r>.npz`` (``<run>|<key>``; ``y`` and ``dx`` hold this
process's rows, listed in ``<run>|rows``) and ``OUT_DIR/rank<r>.json`` (per
run: the graph's names, op counts, or the error). A run that hangs dumps every
thread's stack and exits (faulthandler), failing the job.
"""

import faulthandler
import functools
import json
import os
import sys
import traceback

import numpy as np
import tensorflow as tf

import tf_behavior

tf_behavior.apply()

import horovod.tensorflow as hvd  # noqa: E402

import tf1_syncbn  # noqa: E402
from parity_harness import (build_towers, case_data, graph_info, run_steps,  # noqa: E402
                            sgd_step, tower_rows)
from tf1_syncbn import layers as syncbn_layers  # noqa: E402

tf1 = tf.compat.v1
OUT = sys.argv[1]
with open(os.path.join(OUT, 'job.json')) as _f:
    JOB = json.load(_f)
exec(JOB['model'])  # noqa: S102 - slim_apply, tensorpack_apply, parity_apply
NAME_FILTER = sys.argv[2] if len(sys.argv) > 2 else ''
faulthandler.dump_traceback_later(int(os.environ.get('HANG_SECONDS', '240')), exit=True)


def ours(case, x, weights, training, tower, towers):
    """The case's layer from this library; the training towers synchronize over Horovod."""
    sync = {} if tower is None else {'sync_statistics': 'horovod'}
    if case['front_end'] == 'slim':
        def layer(*args, **kwargs):
            return tf1_syncbn.sync_batch_norm(*args, **dict(kwargs, **sync))
        return slim_apply(layer, case, x, weights, training, tower, towers)  # noqa: F821
    if case['front_end'] == 'tensorpack':
        return tensorpack_apply(tf1_syncbn, case, x, training, tower,  # noqa: F821
                                renorm_takes_training=True, **sync)
    return parity_apply(syncbn_layers, case, x, training, tower, sync)  # noqa: F821


def train_run(case, index, towers, sizes):
    """Trains ``case`` on this process's ``towers`` towers; returns ``(arrays, info)``.

    ``parity_harness.train_case``'s run, with this process's rows of the
    global batch, the parameter gradients summed over processes and the
    variables broadcast from rank 0.
    """
    rank = hvd.rank()
    mine = tower_rows(case, sizes)[rank * towers:(rank + 1) * towers]
    graph = tf.Graph()
    with graph.as_default():
        net = build_towers(functools.partial(ours, case), case, towers)
        # The global gradient: this process's towers' sum, summed over processes.
        var_grads = [hvd.allreduce(g, op=hvd.Sum, name='grad_%d' % k)
                     for k, g in enumerate(net.grads[towers:])]
        train = sgd_step(case, net, var_grads)
        broadcast = hvd.broadcast_global_variables(0)
        info = graph_info(graph)
        ops = graph.get_operations()
        info['horovod_allreduces'] = sum(1 for op in ops if op.type == 'HorovodAllreduce')
        info['collectives'] = sum(1 for op in ops if op.type == 'CollectiveReduce')
        arrays = run_steps(net, train, var_grads, case_data(case, index), mine,
                           lambda parts: np.concatenate(parts).astype(np.float32),
                           start=[broadcast])
    arrays['rows'] = np.concatenate(mine).astype(np.int64)
    return arrays, info


def main():
    hvd.init()
    rank = hvd.rank()
    arrays, infos = {}, {}
    for index, layout, towers, sizes in JOB['runs']:
        case = JOB['cases'][index]
        run = '%s@%s' % (case['name'], layout)
        if NAME_FILTER not in run:
            continue
        try:
            values, info = train_run(case, index, towers, sizes)
        except Exception as e:  # noqa: BLE001 - reported by that run's test
            traceback.print_exc()
            values, info = {}, {'error': '%s: %s' % (type(e).__name__, str(e)[:3000])}
        arrays.update({'%s|%s' % (run, k): v for k, v in values.items()})
        infos[run] = info
    np.savez(os.path.join(OUT, 'rank%d.npz' % rank), **arrays)
    with open(os.path.join(OUT, 'rank%d.json' % rank), 'w') as f:
        json.dump({'size': hvd.size(), 'runs': infos}, f)
    print('rank %d: %d runs' % (rank, len(infos)))


if __name__ == '__main__':
    main()
