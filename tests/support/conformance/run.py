"""Builds a harness's cells in one graph and records every number the oracle has.

One graph per harness (and process): every cell of the run that should
build is built side by side, each front-end on its own towers' inputs in its
own variable scope, and one step runs them all (forward, input and parameter
gradients, the update ops the harness keeps, in one ``session.run``). Then:

* the variables, read in a ``session.run`` of their own (in TF1 behaviour a
  variable fetched in the same run as its update races);
* a ``tf1.train.Saver`` checkpoint, read with ``tf.train.load_checkpoint``;
* the checkpoint restored into a fresh session and read again.

A cell that raises while the graph is built, or whose layer a failed step
names (the run-time check of towers that never built a layer), is taken
out and the graph built and run again without it (a half-built layer would
leave collectives that the step cannot complete); its error is its result.
A failure that names no cell splits the graph's cells in two. A cell
expected to be refused is built alone, in a graph of its own, and its
exception (or its absence) is its result. SyncBNWarnings are recorded per
cell (a warning names the layer, whose scope is the cell's). Where a
harness builds its towers in threads, the cells are split into graphs that
each hold one patch of a family (:func:`_partition`).

A ``tf.estimator`` harness builds and runs its graph itself
(:func:`_run_estimator`); everything else is the same.

Results are keyed as ``parity_harness`` keys its arrays (``y/0``, ``dx/0``,
``grad/0/<variable>``; plus ``var/``, ``saved/`` and ``restored/`` for the
variables), so that ``parity_harness.assert_same_numbers`` compares them.
"""

import contextlib
import dataclasses
import os
import re
import tempfile
import warnings

import numpy as np
import tensorflow as tf

from conformance import front_ends
from conformance import options as opts

tf1 = tf.compat.v1

#: A step may not wait longer than this for its collectives (a hang fails the cell).
STEP_TIMEOUT_MS = 120000
#: The compiled CPU kernels' ops (parity_harness.CUSTOM_KERNEL_OPS).
KERNEL_OPS = ('SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput')
#: Warnings that say nothing about a cell: patch_keras's about tf.keras being Keras 3.
IGNORED_WARNINGS = (r'patch_keras: tf\.keras is Keras 3',)


@dataclasses.dataclass
class Result:
    """What one cell did: its arrays, or the exception that stopped it."""

    arrays: dict = None
    error: BaseException = None
    warnings: list = dataclasses.field(default_factory=list)
    kernel_ops: int = 0


def scope_of(cell_id):
    """A variable scope name for a cell id."""
    return re.sub(r'[^A-Za-z0-9_.]', '_', cell_id)


def _culprits(error, cells):
    """The cells an exception of a graph's build is about: the one that raised it, or the
    cells whose layers its message names (a check over every tower's layers)."""
    raised = getattr(error, 'conformance_cells', None)
    if raised:
        return [cell for cell in cells if cell.id in raised]
    message = str(error)
    if isinstance(error, tf.errors.OpError):
        # What the failed op said, not the names of the nodes it stopped.
        message = '\n'.join(re.findall(r'assertion failed: \[(.*?)\]\n', message))
    return [cell for cell in cells if scope_of(cell.id) + '/' in message]


class _Failed(Exception):
    """Cells that raised while one tower was built: ``errors`` maps each to its exception."""

    def __init__(self, errors):
        super(_Failed, self).__init__('; '.join('%s: %s' % (cell, e) for cell, e in errors.items()))
        self.errors = errors
        self.conformance_cells = list(errors)


def _detached(error):
    """``error`` without what keeps its graph alive (its traceback's frames, its op)."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    if isinstance(error, tf.errors.OpError):
        error._op = None  # noqa: SLF001 - the failed node, and through it its whole graph
    return error


def _tag(error, cell):
    error.conformance_cells = [cell.id]
    return error


def run_cells(harness_type, cells, refused=(), agreement=None):
    """Runs ``cells`` (expected to build) and ``refused`` (each alone) in one harness.

    Args:
      harness_type: a ``harnesses.Harness`` subclass (a fresh one per graph).
      cells: cells expected to build and match (``matrix.Cell``).
      refused: cells expected to be refused at graph build.
      agreement: in a worker process, its :class:`Agreement` with the other
        workers (each graph's step runs only once every worker built the
        same cells).

    Returns:
      ``{cell id: Result}``.

    Raises:
      WorkersDiverged: (``agreement``) another worker built other cells.
    """
    results = {}
    for cell in refused:
        results[cell.id] = _build_alone(harness_type, cell)
    for part in _partition(harness_type, cells):
        results.update(_run_part(harness_type, part, agreement))
    return results


def _partition(harness_type, cells):
    """The cells in graphs that can hold them together.

    Where a harness builds its towers in threads (``Harness.threaded``), a
    patch is entered once around the build, as scripts do: one graph holds
    one patch of a family, and no direct call of that family (a patch may
    lend its arguments to them).
    """
    if not harness_type.threaded:
        return [list(cells)] if cells else []
    parts = []
    for cell in cells:
        key = cell.front_end.patch_key(cell.option, _num_dev(harness_type, cell))
        for part in parts:
            if key is None or part['keys'].get(key[0], key[1]) == key[1]:
                break
        else:
            part = {'cells': [], 'keys': {}}
            parts.append(part)
        part['cells'].append(cell)
        if key is not None:
            part['keys'][key[0]] = key[1]
    return [part['cells'] for part in parts]


def _num_dev(harness, cell):
    """What the cell's user passes as ``num_dev``."""
    return harness.num_dev if cell.option.num_dev else None


def _run_part(harness_type, cells, agreement=None):
    """Runs cells in one graph; the cells that fail it are taken out, the others run again.

    A failure that names no cell (a check over every tower's layers that names
    a Keras layer by its own name) splits the cells in two, each run apart.
    """
    results = {}
    remaining = list(cells)
    while remaining:
        try:
            results.update(_run_graph(harness_type, remaining, agreement))
            break
        except WorkersDiverged:
            raise
        except Exception as e:  # noqa: BLE001 - a cell's error is its result
            culprits = _culprits(e, remaining)
            if not culprits and len(remaining) > 1:
                half = len(remaining) // 2
                for part in (remaining[:half], remaining[half:]):
                    results.update(_run_part(harness_type, part, agreement))
                break
            culprits = culprits or remaining
            for cell in culprits:
                error = e.errors[cell.id] if isinstance(e, _Failed) else e
                results[cell.id] = Result(error=_detached(error), warnings=getattr(
                    e, 'conformance_warnings', {}).get(cell.id, []))
                if agreement is not None:
                    agreement.failed(cell, error)
            remaining = [cell for cell in remaining if cell not in culprits]
    return results


class _Graph(object):
    """One graph's cells: their placeholders, per tower."""

    def __init__(self, harness, cells):
        self.harness = harness
        self.cells = cells
        self.training = tf1.placeholder(tf.bool, [], 'training')
        self.created = {}
        self.inputs = {}
        for cell in cells:
            option = cell.option
            shape = (None,) + option.shape[1:]
            self.inputs[cell.id] = [
                {'x': tf1.placeholder(tf.float32, shape, 'x'),
                 'dy': tf1.placeholder(tf.float32, shape, 'dy'),
                 'weights': tf1.placeholder(tf.float32, [None], 'weights')}
                for _ in option.sizes]

    def tower(self, index):
        """Builds every cell on tower ``index`` and its gradients there."""
        from without_onednn import kernel_set  # noqa: PLC0415
        record = {'cells': {}}
        terms, xs, params, failed = [], [], [], {}
        for cell in self.cells:
            inputs = self.inputs[cell.id][index]
            option, front_end = cell.option, cell.front_end
            training = self.training if option.training_tensor else True
            num_dev = _num_dev(self.harness, cell)
            created = []
            try:
                with kernel_set(cell.kernel_set), tf1.variable_scope(scope_of(cell.id)), \
                        front_ends.recording(created):
                    x = tf.cast(inputs['x'], option.dtype)
                    outputs = front_end.build(x, training, option, num_dev,
                                              weights=inputs['weights'],
                                              patched=self.harness.threaded)
            except Exception as e:  # noqa: BLE001 - the cell's error, raised after the tower
                failed[cell.id] = e
                continue
            # (Variables of other cells, built by other replicas' threads meanwhile, left out.)
            created = [v for v in created if scope_of(cell.id) in _name(v).split('/')]
            # The variables this tower reads: its own (replicated variables), or
            # those the first tower created (shared ones).
            owned = self.created.setdefault(cell.id, {})
            owned[index] = created
            variables = [v for v in created or owned[min(owned)] if v.trainable]
            names = [relative(v, cell) for v in variables]
            trainable = self.harness.replica_variables(variables, index)
            terms.append(tf.reduce_sum(tf.cast(outputs['y'], tf.float32) * inputs['dy']))
            xs.append(inputs['x'])
            params.append((cell, names, trainable))
            record['cells'][cell.id] = {'outputs': outputs}
        if failed:
            if len(self.cells) == 1:
                # The cell's own error, as a user's script gets it (tf.estimator's AutoGraph
                # passes a ValueError or TypeError on as one, not an exception of ours).
                raise _tag(failed[self.cells[0].id], self.cells[0])
            # Every cell that failed in this tower, at once: the graph is built again
            # without them (_run_part), each with its own error.
            raise _Failed(failed)
        flat = [v for _, _, variables in params for v in variables]
        grads = tf.gradients(terms, xs + flat)
        grads = [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
                 for g, x in zip(grads, xs + flat)]
        record['harness_grads'] = list(zip(grads[len(xs):], flat))
        record['loss'] = tf.add_n(terms)
        k = len(xs)
        for (cell, names, variables), dx in zip(params, grads[:len(xs)]):
            record['cells'][cell.id]['dx'] = dx
            record['cells'][cell.id]['grads'] = dict(zip(names, grads[k:k + len(variables)]))
            k += len(variables)
        return record

    def variables(self, cell):
        """The cell's variables as the first tower created them (the saved ones)."""
        owned = self.created[cell.id]
        return {relative(v, cell): v for v in owned[min(owned)]}


def _name(variable):
    """A variable's name (under a strategy, a sync-on-read variable's ``op`` is a read's)."""
    return variable.name.split(':')[0]


def relative(variable, cell):
    """A cell's variable's name below the cell's scope (the name a layer gives it)."""
    parts = _name(variable).split('/')
    return '/'.join(parts[parts.index(scope_of(cell.id)) + 1:])


def _warnings_of(caught, cells):
    """``{cell id: [message]}`` of the SyncBNWarnings that name a cell's scope."""
    from tf1_syncbn import SyncBNWarning  # noqa: PLC0415
    found = {cell.id: [] for cell in cells}
    for w in caught:
        message = str(w.message)
        if not issubclass(w.category, SyncBNWarning) or \
                any(re.search(p, message) for p in IGNORED_WARNINGS):
            continue
        for cell in cells:
            if scope_of(cell.id) + '/' in message or len(cells) == 1:
                found[cell.id].append(message)
    return found


def _build(harness, cells):
    """Builds ``cells`` in ``harness`` in a new graph; returns ``(graph, _Graph, towers)``."""
    graph = tf.Graph()
    with graph.as_default(), _patches(harness, cells):
        built = _Graph(harness, cells)
        try:
            towers = harness.build_towers(built.tower, opts.TOWERS)
        finally:
            harness.close()
            for cell in cells:
                cell.front_end.forget()
    return graph, built, towers


@contextlib.contextmanager
def _patches(harness, cells):
    """Where a harness builds its towers in threads, each cell's patch, once around the build.

    (See :func:`_partition`: the cells of one graph share each kind of patch.)
    """
    with contextlib.ExitStack() as patches:
        if harness.threaded:
            entered = set()
            for cell in cells:
                key = cell.front_end.patch_key(cell.option, _num_dev(harness, cell))
                if key is not None and key[1] != 'direct' and key not in entered:
                    entered.add(key)
                    try:
                        patches.enter_context(cell.front_end.patch(
                            cell.option, _num_dev(harness, cell)))
                    except Exception as e:  # noqa: BLE001 - tagged with its cell, raised again
                        raise _tag(e, cell)
        yield


def _build_alone(harness_type, cell):
    """Builds one cell alone; its result holds the exception it raised (None if none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            harness = harness_type()
            if harness.estimator:
                _run_estimator(harness, [cell])
            else:
                _build(harness, [cell])
            error = None
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            error = _detached(e.errors[cell.id] if isinstance(e, _Failed) else e)
    return Result(error=error, warnings=_warnings_of(caught, [cell])[cell.id])


def _feed(built):
    feed = {built.training: True}
    for cell in built.cells:
        data = cell.data()
        for rows, inputs in zip(opts.tower_rows(cell.option.sizes), built.inputs[cell.id]):
            feed[inputs['x']] = data['x'][rows]
            feed[inputs['dy']] = data['dy'][rows]
            feed[inputs['weights']] = data['weights'][rows]
    return feed


def _place(parts, sizes, indices):
    """Per-tower arrays put back at their rows of the global batch (float32).

    ``indices``: the global towers of ``parts`` (the rows of other towers are 0).
    """
    rows = opts.tower_rows(sizes)
    out = np.zeros((sum(sizes),) + parts[0].shape[1:], np.float32)
    for part, index in zip(parts, indices):
        out[rows[index]] = part
    return out


def _run_graph(harness_type, cells, agreement=None):
    harness = harness_type()
    if harness.estimator:
        return _run_estimator(harness, cells)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            graph, built, towers = _build(harness, cells)
        except Exception as e:
            _keep_warnings(e, caught, cells)
            raise
    with graph.as_default():
        fetches = {'cells': {cell.id: [tower['cells'][cell.id] for tower in towers]
                             for cell in cells},
                   'step': harness.updates(len(towers)) + harness.step_ops()}
        variables = {cell.id: built.variables(cell) for cell in cells}
        saver = tf1.train.Saver(tf1.global_variables())
        init = tf1.global_variables_initializer()
        local_init = tf1.local_variables_initializer()
    if agreement is not None:
        agreement.check(cells)      # before the first collective of the graph
    options = tf1.RunOptions(timeout_in_ms=STEP_TIMEOUT_MS)
    config = harness.session_config(len(towers))
    target = harness.session_target()
    with tf1.Session(target, graph=graph, config=config) as sess:
        sess.run([init, local_init], options=options)
        try:
            values = sess.run(fetches, _feed(built), options=options)
        except Exception as e:
            _name_culprits(e, cells)
            raise
        read = sess.run(variables, options=options)
        with tempfile.TemporaryDirectory() as tmp:
            path = saver.save(sess, os.path.join(tmp, 'model'))
            saved = _saved(path, variables)
            restored = _restore_fresh(graph, path, variables, config, target)
    return _results(cells, values['cells'], variables, read, saved, restored,
                    _kernel_ops(graph, cells), _warnings_of(caught, cells),
                    harness.tower_indices())


def _keep_warnings(error, caught, cells):
    """Gives a build error the warnings of the cells it is about."""
    found = _warnings_of(caught, cells)
    error.conformance_warnings = {cell.id: found[cell.id] for cell in _culprits(error, cells)}


def _name_culprits(error, cells):
    """A run-time check that names layers (towers that never built one): those cells' error.

    The others run again without them (:func:`_run_part`).
    """
    error.conformance_cells = [cell.id for cell in _culprits(error, cells)]


def _saved(path, variables):
    reader = tf.train.load_checkpoint(path)
    return {cell: {rel: _checkpoint_value(reader, v) for rel, v in named.items()}
            for cell, named in variables.items()}


def _results(cells, values, variables, read, saved, restored, kernel_ops, cell_warnings,
             indices=None):
    """Every cell's arrays, keyed as the oracle keys its references.

    ``indices``: the global towers of ``values``' towers (None: every tower, in order).
    """
    results = {}
    for cell in cells:
        per_tower = values[cell.id]
        towers = list(range(len(per_tower))) if indices is None else indices
        arrays = {}
        for name in cell.front_end.outputs:
            parts = [np.asarray(t['outputs'][name], np.float32) for t in per_tower]
            arrays['y/0' if name == 'y' else 'y/%s' % name] = (
                _place(parts, cell.option.sizes, towers) if name == 'y' else np.stack(parts))
        arrays['dx/0'] = _place([t['dx'] for t in per_tower], cell.option.sizes, towers)
        for rel in per_tower[0]['grads']:
            arrays['grad/0/' + rel] = np.sum([t['grads'][rel] for t in per_tower], axis=0)
        for rel in variables[cell.id]:
            arrays['var/' + rel] = read[cell.id][rel]
            arrays['saved/' + rel] = saved[cell.id][rel]
            arrays['restored/' + rel] = restored[cell.id][rel]
        results[cell.id] = Result(arrays=arrays, warnings=cell_warnings[cell.id],
                                  kernel_ops=kernel_ops[cell.id])
    return results


def _run_estimator(harness, cells):
    """The cells in a ``tf.estimator.Estimator``: one ``train(steps=1)`` builds and runs them.

    The ``model_fn`` builds the towers (the harness's loop, or one replica per
    call under ``train_distribute``), applies the towers' gradients with
    learning rate 0 after the ``UPDATE_OPS``, as an Estimator's train op does;
    a hook feeds the cells' inputs and fetches their outputs and gradients in
    the training step, then reads the variables in a run of its own. The
    Estimator's checkpoint is read back, and restored into a fresh session.
    """
    import tensorflow_estimator  # noqa: F401, PLC0415 - tf.estimator's package (2.15)
    state = {'records': {}}

    def model_fn(features, labels, mode):
        del features, labels
        graph = tf1.get_default_graph()
        if state.get('graph') is not graph:
            state.update(graph=graph, built=_Graph(harness, cells), records={})
        built = state['built']
        if harness.model_fn_per_replica:
            context = tf.distribute.get_replica_context()
            index = int(tf.get_static_value(context.replica_id_in_sync_group))
            towers = {index: built.tower(index)}
        else:
            towers = dict(enumerate(harness.build_towers(built.tower, opts.TOWERS)))
        state['records'].update(towers)
        loss = tf.add_n([record['loss'] for record in towers.values()])
        grads = {}
        for record in towers.values():
            for grad, variable in record['harness_grads']:
                grads.setdefault(id(variable), [variable]).append(grad)
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.GradientDescentOptimizer(0.0).apply_gradients(
                [(tf.add_n(g), v) for v, *g in grads.values()],
                global_step=tf1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    class Hook(tf1.train.SessionRunHook):
        def begin(self):
            built = state['built']
            self.fetches = {cell.id: [state['records'][t]['cells'][cell.id]
                                      for t in range(opts.TOWERS)] for cell in cells}
            self.variables = {cell.id: built.variables(cell) for cell in cells}
            # (A read in cross-replica context builds ops: before the graph is finalized.)
            self.reads = {cell: {rel: tf.identity(v) for rel, v in named.items()}
                          for cell, named in self.variables.items()}

        def before_run(self, run_context):
            return tf1.train.SessionRunArgs(self.fetches, feed_dict=_feed(state['built']))

        def after_run(self, run_context, run_values):
            state['values'] = run_values.results

        def end(self, session):
            state['read'] = session.run(self.reads)

    with warnings.catch_warnings(record=True) as caught, \
            tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter('always')
        estimator = tf.estimator.Estimator(model_fn, model_dir=tmp,
                                           config=harness.run_config(opts.TOWERS))
        hook = Hook()
        try:
            with _patches(harness, cells):
                estimator.train(harness.input_fn, steps=1, hooks=[hook])
        except Exception as e:
            _keep_warnings(e, caught, cells)
            _name_culprits(e, cells)
            raise
        path = estimator.latest_checkpoint()
        saved = _saved(path, hook.variables)
        restored = _restore_fresh(state['graph'], path, hook.variables,
                                  harness.session_config(opts.TOWERS))
    return _results(cells, state['values'], hook.variables, state['read'], saved, restored,
                    _kernel_ops(state['graph'], cells), _warnings_of(caught, cells))


def _restore_fresh(graph, path, variables, config, target=''):
    """The variables restored from the checkpoint at ``path`` into a fresh session.

    On a server (``target``, a worker's), whose variables outlive a session,
    the variables are initialized again first.
    """
    with graph.as_default():
        saver = tf1.train.Saver(tf1.global_variables())
        init = tf1.global_variables_initializer() if target else None
    with tf1.Session(target, graph=graph, config=config) as sess:
        if init is not None:
            sess.run(init)
        saver.restore(sess, path)
        return sess.run(variables, options=tf1.RunOptions(timeout_in_ms=STEP_TIMEOUT_MS))


def _checkpoint_value(reader, variable):
    name = _name(variable)
    if reader.has_tensor(name):
        return reader.get_tensor(name)
    return np.full(np.shape(variable), np.nan, np.float32)     # fails the comparison


def _kernel_ops(graph, cells):
    counts = {cell.id: 0 for cell in cells}
    scopes = {scope_of(cell.id): cell.id for cell in cells}
    for op in graph.get_operations():
        if op.type in KERNEL_OPS:
            for part in op.name.split('/'):
                if part in scopes:
                    counts[scopes[part]] += 1
                    break
    return counts


# ---------------------------------------------------------------------------
# Worker processes (Harness.workers): each runs run_cells on its towers.

#: The worker's module (``python -m conformance.worker HARNESS OUT CELL_ID...``).
WORKER_MODULE = 'conformance.worker'
#: How long the workers of one run may take: this, plus :data:`WORKERS_SECONDS_PER_CELL` per
#: cell (:func:`workers_timeout`). make test's cells of a column take 20 to 60 s on 2 busy
#: cores, make test-full's of one kernel set 2 (multi_worker) to 5 minutes
#: (multi_worker_mirrored, 4 processes); past it the launcher stops them and the run fails.
#: (A worker that fails, or builds other cells than its peers, ends the run at once:
#: :class:`Agreement`.)
WORKERS_TIMEOUT = 120
WORKERS_SECONDS_PER_CELL = 4


def workers_timeout(cells):
    """Seconds the workers of a run of ``cells`` cells may take."""
    return WORKERS_TIMEOUT + WORKERS_SECONDS_PER_CELL * cells


class WorkersDiverged(RuntimeError):
    """The workers built different graphs: their collectives would wait on each other."""


class Agreement(object):
    """A worker's check that every worker built the same cells before a graph's step.

    Every worker builds the same graphs in the same order; a cell that fails
    at build on one worker only (a broken worker) would leave the others'
    collectives waiting on it until the step's timeout, and then split the
    graph and wait again. Before each graph's first ``session.run``, each worker
    writes the cells it built (and the build errors it has had) to a file of
    the run's folder (every worker is on this host: ``Harness.launch``), and
    waits for every other worker's file of that graph, or the file that says
    it has ended (:meth:`end`): where they differ, it raises
    :class:`WorkersDiverged`, naming the cells they differ in and the other
    worker's errors, and the worker exits with it (the launcher then stops
    the others).

    Args:
      folder: the run's folder (``run_cells_in_workers``' ``OUT``).
      rank: this worker's rank.
      workers: how many workers.
      timeout: seconds to wait for another worker's file; None: until it is
        there (the launcher stops the run at its timeout anyway, and at once
        when a worker has failed).
    """

    def __init__(self, folder, rank, workers, timeout=None):
        self.folder, self.rank, self.workers, self.timeout = folder, rank, workers, timeout
        self.graphs = 0
        self.errors = {}

    def failed(self, cell, error):
        """Records a cell's error on this worker (for the others' message)."""
        self.errors[cell.id] = '%s: %s' % (type(error).__name__, ' '.join(str(error).split())[:600])

    def _write(self, name, content):
        import json  # noqa: PLC0415
        path = os.path.join(self.folder, name)
        with open(path + '.tmp', 'w') as f:
            json.dump(content, f)
        os.replace(path + '.tmp', path)

    def _read(self, name):
        import json  # noqa: PLC0415
        path = os.path.join(self.folder, name)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def end(self):
        """Says that this worker has built every graph (and its errors)."""
        self._write('end.worker%d.json' % self.rank, {'graphs': self.graphs,
                                                      'errors': self.errors})

    def check(self, cells):
        """Returns once every worker built ``cells`` in its graph of this number.

        Raises:
          WorkersDiverged: another worker built other cells, ended without
            this graph, or did not build it within ``timeout`` s.

        Hangs: up to ``timeout`` s (None: until the launcher stops the run),
        waiting for the slowest worker's build.
        """
        import time  # noqa: PLC0415
        graph, self.graphs = self.graphs, self.graphs + 1
        mine = sorted(cell.id for cell in cells)
        self._write('graph%d.worker%d.json' % (graph, self.rank), {'cells': mine,
                                                                   'errors': self.errors})
        deadline = None if self.timeout is None else time.time() + self.timeout
        for rank in range(self.workers):
            while True:
                theirs = self._read('graph%d.worker%d.json' % (graph, rank))
                ended = None if theirs else self._read('end.worker%d.json' % rank)
                if theirs or ended:
                    break
                if deadline is not None and time.time() > deadline:
                    raise WorkersDiverged('conformance worker %d: worker %d did not build its '
                                          'graph %d within %g s' % (self.rank, rank, graph,
                                                                    self.timeout))
                time.sleep(0.05)
            if ended:
                raise WorkersDiverged(
                    'conformance worker %d: worker %d ended after %d graphs, while this one '
                    'built graph %d (%d cells): they built different cells; worker %d\'s '
                    'errors: %s' % (self.rank, rank, ended['graphs'], graph, len(mine), rank,
                                    _listed(ended['errors'])))
            if theirs['cells'] != mine:
                differ = sorted(set(mine) ^ set(theirs['cells']))
                raise WorkersDiverged(
                    'conformance worker %d: workers %d and %d built different cells in graph '
                    '%d: %s built by one of them only; worker %d\'s errors: %s'
                    % (self.rank, self.rank, rank, graph, differ, rank,
                       _listed(theirs['errors'])))


def _listed(errors):
    return '; '.join('%s: %s' % item for item in sorted(errors.items())) or 'none'


def save_worker_results(results, path):
    """Writes a worker's ``{cell id: Result}`` to ``path`` (errors as their type and text)."""
    import pickle  # noqa: PLC0415
    plain = {}
    for cell_id, result in results.items():
        error = result.error
        plain[cell_id] = dataclasses.replace(
            result, error=None if error is None else (type(error).__name__, str(error)))
    with open(path, 'wb') as f:
        pickle.dump(plain, f)


def _load_worker_results(path):
    import pickle  # noqa: PLC0415
    with open(path, 'rb') as f:
        plain = pickle.load(f)  # noqa: S301 - our own workers' file
    for result in plain.values():
        if result.error is not None:
            name, text = result.error
            kind = {'ValueError': ValueError, 'TypeError': TypeError}.get(name)
            result.error = kind(text) if kind else RuntimeError('%s: %s' % (name, text))
    return plain


def run_cells_in_workers(harness, cells, refused=()):
    """:func:`run_cells` of a worker harness, in ``harness.workers`` worker processes.

    The workers are started by the column (``harness.launch``: a
    ``tf1_syncbn.launch.Launcher`` on localhost, ``horovodrun``, ...), in
    this process's TF behaviour and environment (its kernel set's variables);
    each runs every cell on its towers and writes its results. A cell's arrays
    are assembled from the workers' (each worker's towers' rows and outputs,
    the gradients summed); its variables are worker 0's, and must be the same
    on every worker. A cell refused or failed on some worker has that error.

    Args:
      harness: a harness with ``workers`` (``harnesses.MultiWorker``), its
        ``launch`` and ``join``.
      cells, refused: as :func:`run_cells`.

    Returns:
      ``{cell id: Result}``.

    Raises:
      RuntimeError: when a worker fails or writes no results (its output's end).
    """
    import sys  # noqa: PLC0415

    import support_paths  # noqa: PLC0415
    import tf_behavior  # noqa: PLC0415
    ids = [cell.id for cell in cells] + ['refused:' + cell.id for cell in refused]
    if not ids:
        return {}
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
                   PYTHONPATH=support_paths.pythonpath(os.environ.get('PYTHONPATH')))
        command = [sys.executable, '-m', WORKER_MODULE, harness.name, out]
        status, text = harness.launch(command + tf_behavior.flag() + ids, env,
                                      workers_timeout(len(ids)))
        paths = [os.path.join(out, 'worker%d.pkl' % rank) for rank in range(harness.workers)]
        if status != 0 or not all(os.path.exists(p) for p in paths):
            raise RuntimeError('the conformance workers failed (%s):\n%s'
                               % (status, text[-6000:]))
        per_worker = [_load_worker_results(p) for p in paths]
    options = {cell.id: cell.option for cell in list(cells) + list(refused)}
    return {cell_id: _assemble([found[cell_id] for found in per_worker],
                               same_variables=options[cell_id].sync is not None)
            for cell_id in per_worker[0]}


def _assemble(parts, same_variables=True):
    """One cell's Result from its workers' (worker order = global tower order).

    ``same_variables``: the variables must be equal on every worker. Not with
    ``sync_statistics=None``: nothing crosses the workers, each worker's moving
    statistics are its own first tower's (as the replaced layer's in processes
    of their own), and worker 0's are global tower 0's, the oracle's.
    """
    warnings_ = [w for part in parts for w in part.warnings if w not in parts[0].warnings]
    warnings_ = parts[0].warnings + warnings_
    errors = [part.error for part in parts]
    if any(error is not None for error in errors):
        first = next(error for error in errors if error is not None)
        if all(type(error) is type(first) for error in errors):
            return Result(error=first, warnings=warnings_)
        # Not the same on every worker (a worker's own failure): each worker's.
        return Result(error=RuntimeError('the workers disagree: %s' % '; '.join(
            'worker %d %s' % (rank, 'built it' if error is None else 'raised %s: %s' % (
                type(error).__name__, error)) for rank, error in enumerate(errors))),
            warnings=warnings_)
    if parts[0].arrays is None:
        return Result(warnings=warnings_)        # a cell expected to be refused, built
    arrays = {}
    for key, value in parts[0].arrays.items():
        values = [part.arrays[key] for part in parts]
        if key in ('y/0', 'dx/0') or key.startswith('grad/'):
            arrays[key] = np.sum(values, axis=0)          # rows of other towers are 0
        elif key.startswith('y/'):
            arrays[key] = np.concatenate(values)          # stacked per tower
        else:
            for rank, other in enumerate(values[1:] if same_variables else (), 1):
                if not np.array_equal(other, value, equal_nan=True):
                    return Result(error=AssertionError(
                        '%s differs between worker 0 and worker %d: %s and %s'
                        % (key, rank, value.tolist(), other.tolist())), warnings=warnings_)
            arrays[key] = value
    return Result(arrays=arrays, warnings=warnings_, kernel_ops=parts[0].kernel_ops)
