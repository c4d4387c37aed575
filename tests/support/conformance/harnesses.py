"""The matrix's columns: the harnesses that build towers, written as their scripts do.

A :class:`Harness` builds one graph's towers: for each of its towers it
enters the harness's own context (name scope, device, variable reuse, tower
context, replica) and calls ``tower_fn(index)``, which builds every cell's
layer on that tower and its gradients there, as a training script builds
its loss and ``compute_gradients`` per tower. It then says which update ops
a step runs (the harness's own choice: the last tower's, the first clone's,
all of them). ``run.py`` does the rest (data, the step, the variables, the
``Saver``).

What users add in each harness (``num_dev`` where towers are only name
scopes) is :attr:`Harness.num_dev`. A harness whose towers are other
processes starts them itself (:attr:`Harness.workers`, :meth:`Harness.launch`);
one whose cells need what ``make test`` does not have (Horovod) names the
test module that runs them (:attr:`Harness.runs_in`); one that does not
exist on this TensorFlow says so (:meth:`Harness.unavailable`).

To add a harness: a subclass here, an instance in :data:`HARNESSES`, and the
row(s) of docs/harnesses.md's table it covers in :attr:`Harness.docs_rows`
(the completeness test maps every row of that table to a column).
"""

import contextlib

import tensorflow as tf

from conformance import front_ends as fes
from conformance import options as opts

tf1 = tf.compat.v1


class Harness(object):
    """One column of the matrix.

    Attributes:
      name: the column's id (test ids, the page).
      title: how the page names it.
      docs_rows: the first cells of docs/harnesses.md's table ("Which
        harnesses, and what you add") that this column covers.
      num_dev: what users pass as ``num_dev`` (None: nothing, the harness
        names its towers).
      adds: what users add, for the page, where it is not ``num_dev``.
      keeps: whose update ops a step runs, for the page.
      marks: pytest marks of the column's cells (``versions``: the version
        subset runs them).
    """

    name = None
    title = None
    docs_rows = ()
    num_dev = None
    adds = None
    keeps = 'every tower'
    marks = ()
    #: Builds its towers in threads (``tf.distribute``'s replicas): a patch is entered
    #: once around the whole build, as scripts do, not around each call.
    threaded = False
    #: A ``tf.estimator.Estimator`` runs the graph (``run._run_estimator``).
    estimator = False
    #: Worker processes that run the column's cells (0: this process runs them).
    workers = 0
    #: A ``tf.distribute`` strategy's replicas: tf-keras' moving statistics (synchronized
    #: on read, MEAN) are one copy per replica, read, saved and restored as their mean.
    replica_copies = False
    #: None: ``tests/conformance/`` runs the column's cells; else the test module (and make
    #: target) that does, where they need what ``make test`` does not have (Horovod).
    runs_in = None

    def unavailable(self):
        """Why the harness does not exist on this TensorFlow, or None."""
        return None

    def not_applicable(self, front_end, option):
        """Why a cell has no meaning in this harness, or None."""
        del front_end
        if not option.num_dev and self.num_dev is None:
            return 'the harness names its towers: users pass no num_dev here'
        return None

    def build_towers(self, tower_fn, towers):
        """Builds ``tower_fn(index)`` in each tower; returns the results, in tower order."""
        raise NotImplementedError

    def updates(self, towers):
        """The update ops a step runs (this harness's choice)."""
        del towers
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)

    def step_ops(self):
        """Ops of the harness the step runs besides the updates (a trainer's train op)."""
        return []

    def replica_variables(self, variables, index):
        """What tower ``index`` reads of ``variables`` (a replica's own copy, under a strategy)."""
        del index
        return variables

    def tower_indices(self):
        """The global indices of the towers this process builds, in build order."""
        return list(range(opts.TOWERS))

    def session_target(self):
        """The target of the harness's sessions (a worker's server)."""
        return ''

    def session_config(self, towers):
        from tower import virtual_cpu_config  # noqa: PLC0415
        return virtual_cpu_config(towers)

    def close(self):
        """Undoes what building changed outside the graph (registered patterns)."""

    # A column whose towers are processes (``workers`` > 0): ``run.run_cells_in_workers``
    # launches them, each runs ``python -m conformance.worker`` (``conformance/worker.py``).

    def launch(self, command, env, timeout):
        """Runs ``command`` in :attr:`workers` processes of this column; waits for them.

        Args:
          command: the worker's command line (``python -m conformance.worker ...``).
          env: the workers' environment.
          timeout: seconds; past it every worker is stopped.

        Returns:
          ``(status, output)``: 0 when every worker exited with 0, and their output.
        """
        raise NotImplementedError('%s builds its towers in this process' % self.name)

    def join(self):
        """In a worker process: joins the column's other workers; returns this one's rank."""
        raise NotImplementedError('%s builds its towers in this process' % self.name)


def _devices(towers):
    return ['/cpu:%d' % i for i in range(towers)]


class TowerLoop(Harness):
    """``cifar10_multi_gpu_train.py`` / ``inception_train.py``: ``tower_%d`` scopes."""

    name = 'tower_loop'
    title = 'a `tower_%d` loop (cifar10_multi_gpu_train)'
    docs_rows = ('classic loops (`cifar10_multi_gpu_train.py`, `inception_train.py`)',)
    num_dev = opts.TOWERS
    keeps = 'the last tower'
    scope_format = 'tower_%d'

    def build_towers(self, tower_fn, towers):
        results = []
        for i in range(towers):
            with tf.device('/cpu:%d' % i), tf.name_scope(self.scope_format % i):
                results.append(tower_fn(i))
                tf1.get_variable_scope().reuse_variables()
        return results

    def updates(self, towers):
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, self.scope_format % (towers - 1))


class RegisteredPattern(TowerLoop):
    """A script's own tower scopes (``gpu%d``), registered with ``register_tower_pattern``."""

    name = 'registered_pattern'
    title = 'your own name scopes (`gpu%d`, registered)'
    docs_rows = ('your own name scopes',)
    keeps = 'every tower'
    scope_format = 'gpu%d'
    PATTERN = r'gpu([0-9]+)'

    def build_towers(self, tower_fn, towers):
        import tower  # noqa: PLC0415
        tower.register_tower_pattern(self.PATTERN)
        self._registered = True
        return super(RegisteredPattern, self).build_towers(tower_fn, towers)

    def updates(self, towers):
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)

    def close(self):
        if getattr(self, '_registered', False):
            import tower  # noqa: PLC0415
            tower.unregister_tower_pattern(self.PATTERN)
            self._registered = False


class ModelDeploy(Harness):
    """tf-slim's ``model_deploy`` (``train_image_classifier.py``): ``clone_%d`` scopes.

    tf-slim 1.1 does not ship ``deployment/model_deploy.py`` (it lives in
    tensorflow/models' research/slim); its conventions, as
    ``tests/tower/test_tower_name_scopes.py`` inlines them: each clone in
    ``tf.name_scope('clone_%d')`` on its device, variables shared with
    ``variable_scope(reuse=i > 0)``, and the first clone's ``UPDATE_OPS``.
    """

    name = 'model_deploy'
    title = 'tf-slim `model_deploy` clones'
    docs_rows = ('tf-slim `model_deploy` (`train_image_classifier.py`)',)
    num_dev = opts.TOWERS
    keeps = 'the first clone'

    def build_towers(self, tower_fn, towers):
        results = []
        for i in range(towers):
            with tf.name_scope('clone_%d' % i), tf.device('/cpu:%d' % i):
                with tf1.variable_scope(tf1.get_variable_scope(), reuse=True if i > 0 else None):
                    results.append(tower_fn(i))
        return results

    def updates(self, towers):
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'clone_0')


class TowerContextHarness(Harness):
    """This library's ``tower.call_for_each_tower`` (a ``TowerContext`` per tower)."""

    name = 'tower_context'
    title = '`tower.call_for_each_tower` / `TowerContext`'
    docs_rows = ('`tower.call_for_each_tower` / `tower.TowerContext`',)

    def build_towers(self, tower_fn, towers):
        from tower import call_for_each_tower, get_current_tower_context  # noqa: PLC0415
        return call_for_each_tower(lambda: tower_fn(get_current_tower_context().index),
                                   _devices(towers))


class UnnamedLoop(Harness):
    """A hand-written loop that names no tower: ``tf.device`` and variable reuse only."""

    name = 'unnamed_loop'
    title = 'a loop with no tower name (`tf.device` + reuse)'
    keeps = 'the first copy'
    docs_rows = ('a hand-written loop with no tower name (`tf.device` and '
                 "`tf.variable_scope('', reuse=i > 0)` only, or an unregistered `gpu_<i>` "
                 'name scope)',)

    def not_applicable(self, front_end, option):
        del front_end
        if not option.num_dev:
            return 'users pass no num_dev in any cell of this column'
        return None

    def build_towers(self, tower_fn, towers):
        results = []
        for i in range(towers):
            with tf.device('/cpu:%d' % i), tf1.variable_scope('', reuse=i > 0):
                results.append(tower_fn(i))
            if i == 0:
                self._first = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
        return results

    def updates(self, towers):
        # Copies that name no tower each update the statistics (with sync_statistics=None):
        # the script keeps the first copy's update ops, as model_deploy keeps the first
        # clone's (every copy's would apply four updates, in no set order).
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[:self._first]


class _Strategy(Harness):
    """A ``tf.compat.v1.distribute`` strategy: ``strategy.run`` builds the replicas."""

    docs_rows = ('TensorFlow\'s `tf.distribute` strategies in a TF1 graph '
                 '(`tf.compat.v1.distribute.MirroredStrategy`, '
                 '`tf.compat.v1.distribute.experimental.CentralStorageStrategy`, '
                 '`tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy`)',)
    keeps = 'every replica (the strategy merges them)'
    threaded = True
    replica_copies = True

    def make_strategy(self, towers):
        raise NotImplementedError

    def build_towers(self, tower_fn, towers):
        self.strategy = self.make_strategy(towers)
        results = {}

        def replica_fn():
            context = tf.distribute.get_replica_context()
            index = int(tf.get_static_value(context.replica_id_in_sync_group))
            results[index] = tower_fn(index)

        with self.strategy.scope():
            self.strategy.run(replica_fn)
        # This process's replicas, in order (global indices: a worker's are its own).
        return [results[i] for i in sorted(results)]

    def replica_variables(self, variables, index):
        # The replica's own copy of a mirrored variable is what its tower reads.
        return [self.strategy.experimental_local_results(v)[index]
                if len(self.strategy.experimental_local_results(v)) > 1 else v
                for v in variables]


class Mirrored(_Strategy):
    name = 'mirrored'
    title = '`tf.compat.v1.distribute.MirroredStrategy`'

    def make_strategy(self, towers):
        return tf1.distribute.MirroredStrategy(_devices(towers))


class CentralStorage(_Strategy):
    name = 'central_storage'
    title = '`tf.compat.v1.distribute.experimental.CentralStorageStrategy`'
    docs_rows = ()

    def make_strategy(self, towers):
        return tf1.distribute.experimental.CentralStorageStrategy(
            _devices(towers), parameter_device='/cpu:0')


class _Tensorpack(Harness):
    """tensorpack 0.11's multi-GPU trainers' graph builders, towers ``tower<k>`` on CPUs.

    The trainers' ``_setup_graph`` is ``builder.call_for_each_tower(tower_fn)``
    then ``builder.build(grads, get_opt_fn)``; the step's update ops are every
    ``UPDATE_OPS`` (tensorpack's ``RunUpdateOps``). tensorpack puts tower
    ``k`` on ``/gpu:<k>``: ``tensorpack_devices.towers_on_virtual_cpus``
    moves it to ``/cpu:<k>``, the one override of tensorpack the tests make.
    """

    docs_rows = ("tensorpack's multi-GPU trainers (`SyncMultiGPUTrainerParameterServer`, "
                 '`SyncMultiGPUTrainerReplicated`)',)
    keeps = 'every tower (`RunUpdateOps`)'

    def make_builder(self, towers):
        raise NotImplementedError

    def build_towers(self, tower_fn, towers):
        from tensorpack_devices import towers_on_virtual_cpus  # noqa: PLC0415
        from tensorpack.tfutils.tower import get_current_tower_context  # noqa: PLC0415
        towers_on_virtual_cpus()
        builder = self.make_builder(towers)
        grads = []

        def tower():
            result = tower_fn(get_current_tower_context().index)
            grads.append(result['harness_grads'])
            return result

        results = builder.call_for_each_tower(tower)
        built = builder.build(grads, lambda: tf1.train.GradientDescentOptimizer(0.0))
        self._train_op = built[0] if isinstance(built, tuple) else built
        return results

    def step_ops(self):
        return [self._train_op]

    def session_config(self, towers):
        # tensorpack applies the replicated trainer's gradients on '/gpu:<k>' (its
        # tensorpack_harness.py runs so too): placed on the CPUs by soft placement.
        from tower import virtual_cpu_config  # noqa: PLC0415
        return virtual_cpu_config(towers, allow_soft_placement=True)


class TensorpackParameterServer(_Tensorpack):
    name = 'tensorpack_ps'
    title = "tensorpack's `SyncMultiGPUTrainerParameterServer`"

    def make_builder(self, towers):
        from tensorpack.graph_builder.training import (  # noqa: PLC0415
            SyncMultiGPUParameterServerBuilder)
        return SyncMultiGPUParameterServerBuilder(list(range(towers)), 'cpu')


class TensorpackReplicated(_Tensorpack):
    name = 'tensorpack_replicated'
    title = "tensorpack's `SyncMultiGPUTrainerReplicated` (each tower's own variables)"
    docs_rows = ()

    def not_applicable(self, front_end, option):
        if front_end.family == 'keras':
            return ("tensorpack's replicated trainer pairs the towers' copies by variable "
                    "scope; Keras names a layer's weights by the tower's name scope "
                    "(`tower0/...`), which the trainer refuses (tf-keras' own layer too): "
                    'the parameter-server trainer runs Keras models')
        return super(TensorpackReplicated, self).not_applicable(front_end, option)

    def make_builder(self, towers):
        from tensorpack.graph_builder.training import (  # noqa: PLC0415
            SyncMultiGPUReplicatedBuilder)
        return SyncMultiGPUReplicatedBuilder(list(range(towers)), True, 'cpu')


def _estimator_missing():
    if hasattr(tf, 'estimator') and hasattr(tf.estimator, 'Estimator'):
        return None
    return 'tf.estimator exists up to TensorFlow 2.15 (this is %s)' % tf.__version__


class _Estimator(Harness):
    """``tf.estimator.Estimator`` (TensorFlow 2.15): the version subset runs its cells.

    The ``model_fn`` builds the cells (``run._run_estimator``); the input
    function gives nothing the cells read (a hook feeds their inputs).
    """

    marks = ('versions',)
    estimator = True
    model_fn_per_replica = False

    def unavailable(self):
        return _estimator_missing()

    @staticmethod
    def input_fn():
        return tf.data.Dataset.from_tensors(({'unused': [0.0]}, [0.0])).repeat()

    def run_config(self, towers):
        return tf.estimator.RunConfig(session_config=self.session_config(towers),
                                      save_summary_steps=None, log_step_count_steps=None)


class EstimatorMirrored(_Estimator):
    name = 'estimator_mirrored'
    title = '`tf.estimator` with `train_distribute=MirroredStrategy`'
    docs_rows = ('`tf.estimator.Estimator` (TensorFlow 2.15, the last release that has it) '
                 'with `RunConfig(train_distribute=tf.compat.v1.distribute.MirroredStrategy'
                 '(...))`',)
    keeps = 'every replica (the strategy merges them)'
    threaded = True
    replica_copies = True
    model_fn_per_replica = True

    def run_config(self, towers):
        return tf.estimator.RunConfig(
            session_config=self.session_config(towers), save_summary_steps=None,
            log_step_count_steps=None,
            train_distribute=tf1.distribute.MirroredStrategy(_devices(towers)))

    def replica_variables(self, variables, index):
        strategy = tf.distribute.get_strategy()
        return [strategy.experimental_local_results(v)[index]
                if len(strategy.experimental_local_results(v)) > 1 else v
                for v in variables]


class EstimatorTowers(_Estimator, TowerLoop):
    name = 'estimator_towers'
    title = 'a `model_fn` that builds `tower_%d` towers'
    docs_rows = ('a `model_fn` that builds its own towers (`tower_<i>` name scopes, one per '
                 'device) in a plain `Estimator`',)
    num_dev = opts.TOWERS
    keeps = 'every tower'

    def updates(self, towers):
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)


class _Launched(Harness):
    """A column whose workers ``tf1_syncbn.launch.Launcher`` starts on localhost (``TF_CONFIG``)."""

    #: Seconds the other workers get to end on their own after one fails (then stopped).
    GRACE = 5

    def launch(self, command, env, timeout):
        from tf1_syncbn.launch import Launcher  # noqa: PLC0415
        launcher = Launcher(command, self.workers, env=env, output=None,
                            grace=self.GRACE).start()
        status = launcher.wait(timeout=timeout)    # stops them all past it
        # The worker that failed first last, where the caller's tail of the output shows it.
        first = launcher.failed[0] if launcher.failed else None
        ranks = sorted(range(self.workers), key=lambda rank: rank == first)
        text = ['[worker %d] %s' % (rank, line) for rank in ranks for line in launcher.lines[rank]]
        if first is not None:
            text.append('[launcher] worker %d failed first (status %d)' % launcher.failed)
        return status, '\n'.join(text)


class MultiWorker(_Launched):
    """Worker processes (``tf1_syncbn.distributed``): 2 workers x 2 towers each.

    Each worker builds its own towers in ``tower.call_for_each_tower`` on
    ``cluster.tower_devices``, and every layer passes
    ``sync_statistics=cluster.backend()``: global tower ``g`` is worker
    ``g // 2``'s tower ``g % 2``, so the 4 global towers are the oracle's.
    The cells run in 2 worker processes started by
    ``tf1_syncbn.launch.Launcher`` (``run.run_cells_in_workers``, the worker:
    ``conformance/worker.py``); a worker runs ``run.run_cells`` on this
    harness with :attr:`cluster` set.
    """

    name = 'multi_worker'
    title = 'worker processes (`tf1_syncbn.distributed`)'
    adds = '`sync_statistics=cluster.backend()` (the towers: `call_for_each_tower`)'
    docs_rows = ('one process per device without Horovod',)
    #: Worker processes, and towers in each (WORKERS * LOCAL_TOWERS == opts.TOWERS).
    WORKERS, LOCAL_TOWERS = 2, 2
    workers = WORKERS
    #: The worker's ``tf1_syncbn.distributed`` cluster (set in a worker process by ``join``).
    cluster = None

    def join(self):
        from tf1_syncbn.distributed import setup_cluster, wait_for_peers  # noqa: PLC0415
        cluster = setup_cluster(towers=self.LOCAL_TOWERS, startup_timeout=120,
                                collective_timeout=120)
        type(self).cluster = cluster
        wait_for_peers(cluster)
        return cluster.rank

    def tower_indices(self):
        rank = self.cluster.rank
        return [rank * self.LOCAL_TOWERS + t for t in range(self.LOCAL_TOWERS)]

    def build_towers(self, tower_fn, towers):
        from tower import call_for_each_tower, get_current_tower_context  # noqa: PLC0415
        del towers
        first = self.cluster.rank * self.LOCAL_TOWERS
        with fes.synchronizing_with(self.cluster.backend()):
            return call_for_each_tower(
                lambda: tower_fn(first + get_current_tower_context().index),
                self.cluster.tower_devices)

    def session_target(self):
        return self.cluster.target

    def session_config(self, towers):
        return self.cluster.config


class MultiWorkerMirrored(_Launched, _Strategy):
    """``tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy``: 4 workers x 1 replica.

    The strategy runs one replica per worker on CPUs (it counts GPUs only),
    so global tower ``g`` is worker ``g``'s replica (``replica_id_in_sync_group``
    ``g``), and the 4 global towers are the oracle's. Each worker sets up the
    strategy as TensorFlow does for a v1 graph (as
    ``tests/support/for_tower/distribute_worker.py``): the strategy reads
    ``TF_CONFIG`` (the ``Launcher`` sets it), ``update_config_proto`` gives the
    sessions' config (collective group leader, device filters), a
    ``tf.distribute.Server`` for this task (:meth:`join`), the sessions on its
    target; a new strategy per graph, as a script builds one in its graph. The
    layers pass nothing: ``'auto'`` synchronizes over every worker's replica.
    """

    name = 'multi_worker_mirrored'
    title = '`tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy` (worker processes)'
    docs_rows = ()
    #: One replica per worker process (global tower = rank).
    workers = opts.TOWERS
    #: The worker's server, its sessions' config and its rank (set in a worker by ``join``).
    server = config = rank = None
    #: Strategies made in this process (each graph's collectives get keys of their own).
    strategies = 0
    #: Collective group keys per strategy (a graph uses a few).
    KEYS_PER_STRATEGY = 1000

    def join(self):
        import json  # noqa: PLC0415
        import os  # noqa: PLC0415
        spec = json.loads(os.environ['TF_CONFIG'])
        rank = int(spec['task']['index'])
        with tf.Graph().as_default():
            config = tf1.distribute.experimental.MultiWorkerMirroredStrategy(
            ).update_config_proto(tf1.ConfigProto())
        server = tf.distribute.Server(tf.train.ClusterSpec(spec['cluster']), job_name='worker',
                                      task_index=rank, config=config)
        cls = type(self)
        cls.server, cls.config, cls.rank = server, config, rank
        return rank

    def make_strategy(self, towers):
        # A strategy numbers its collectives (its variables' initial broadcasts) from
        # _collective_key_base in each graph anew, and a worker's server keeps what it
        # learnt of a key across sessions: a later graph whose variables have other shapes
        # fails ("Shape mismatch in the collective instance"), and aborts every collective
        # of the process. Each graph's strategy starts at a base of its own, as
        # TensorFlow's tests set it (the same on every worker: they make the same graphs).
        cls = type(self)
        cls.strategies += 1
        strategy_class = tf1.distribute.experimental.MultiWorkerMirroredStrategy
        keyed = type(strategy_class.__name__, (strategy_class,),
                     {'_collective_key_base': cls.strategies * self.KEYS_PER_STRATEGY})
        return keyed()

    def tower_indices(self):
        return [self.rank]

    def session_target(self):
        return self.server.target

    def session_config(self, towers):
        return self.config


class Horovod(Harness):
    """Horovod's convention: one process per device under ``horovodrun --gloo``, 4 x 1 tower.

    Each process builds its one tower outside any tower context (as a
    Horovod script builds its model), and every layer passes
    ``sync_statistics='horovod'``, as docs/horovod.md tells users: global
    tower ``g`` is process ``g`` (``hvd.rank()``), so the 4 global towers are
    the oracle's. The cells run in 4 processes started by ``horovodrun``
    (``tests/with_horovod/horovod_run.py``) from ``run.run_cells_in_workers``;
    a process runs ``run.run_cells`` on this harness after ``hvd.init()``.
    Sync groups across processes are refused by the backend (a group would
    need a Horovod process set, registered by ``hvd.init``).

    Its cells need Horovod: they run in ``make test-horovod``
    (:attr:`runs_in`), not in ``tests/conformance/``.
    """

    name = 'horovod'
    title = "Horovod (`sync_statistics='horovod'`, one process per device)"
    adds = "`sync_statistics='horovod'` (one tower per process, built outside any tower)"
    docs_rows = ('one process per device under `horovodrun`, as `hvd.SyncBatchNormalization`',)
    keeps = 'every process (its one tower)'
    workers = opts.TOWERS
    runs_in = 'tests/with_horovod/test_horovod_conformance.py (make test-horovod)'
    #: Horovod's stall inspector ends a job whose processes wait on a peer that never
    #: submits (a layer skipped): warning after W seconds, shutdown S seconds later
    #: (docs/horovod.md), with Horovod's own message; the launch's limit
    #: (``run.workers_timeout``, 176 s for the TF1 pass's 14 cells) stops it otherwise.
    STALL_SECONDS = (60, 120)

    def not_applicable(self, front_end, option):
        del front_end
        if not option.num_dev:
            return ('one tower per process, built outside any tower: users pass no num_dev '
                    'here')
        return None

    def launch(self, command, env, timeout):
        # oneDNN off in every process: the one launch runs both kernel sets (the stock
        # set's CPU stand-in for GPU towers needs it off, as without_onednn's child run).
        from with_horovod.horovod_run import run_command  # noqa: PLC0415 - needs tests/
        from without_onednn import CHILD_ENV  # noqa: PLC0415
        warning, shutdown = self.STALL_SECONDS
        env = dict(env, TF_ENABLE_ONEDNN_OPTS=CHILD_ENV['TF_ENABLE_ONEDNN_OPTS'])
        job = run_command(command, np=self.workers, env=env, timeout=timeout,
                          horovodrun_args=['--stall-check-warning-time-seconds', str(warning),
                                           '--stall-check-shutdown-time-seconds',
                                           str(shutdown)])
        return job.returncode, job.output

    def join(self):
        import horovod.tensorflow as hvd  # noqa: PLC0415
        from without_onednn import onednn_off_here  # noqa: PLC0415
        hvd.init()
        if hvd.size() != self.workers or not onednn_off_here():
            raise RuntimeError('horovod: %d processes (expected %d), oneDNN %s (expected off)'
                               % (hvd.size(), self.workers,
                                  'off' if onednn_off_here() else 'on'))
        return hvd.rank()

    def tower_indices(self):
        import horovod.tensorflow as hvd  # noqa: PLC0415
        return [hvd.rank()]

    def build_towers(self, tower_fn, towers):
        del towers
        with fes.synchronizing_with('horovod'):
            return [tower_fn(self.tower_indices()[0])]


HARNESSES = (TowerLoop(), TowerContextHarness(), ModelDeploy(), RegisteredPattern(),
             UnnamedLoop(), Mirrored(), CentralStorage(), TensorpackParameterServer(),
             TensorpackReplicated(), EstimatorMirrored(), EstimatorTowers(), MultiWorker(),
             MultiWorkerMirrored(), Horovod())
BY_NAME = {harness.name: harness for harness in HARNESSES}
assert len(BY_NAME) == len(HARNESSES)


@contextlib.contextmanager
def built(harness):
    """Closes the harness after a build (registered patterns are unregistered)."""
    try:
        yield harness
    finally:
        harness.close()
