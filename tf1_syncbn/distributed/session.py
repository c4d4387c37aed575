"""``WorkerSession``: start-up checks, identical start, chief-only checkpoints, lost workers."""

import logging
import os
import sys
import threading
import time

import tensorflow as tf

from tf1_syncbn.distributed.cluster import check_seconds
from tf1_syncbn.distributed.collectives import broadcast_variables
from tf1_syncbn.distributed.errors import (EXIT_STARTUP_HANG, PeerMissingError, WorkerLostError,
                                           hard_exit)
from tf1_syncbn.distributed.peers import unreachable_peers, wait_for_peers
from tf1_syncbn.launch.restarts import RESTART_COUNT_ENV, start_line

tf1 = tf.compat.v1
log = logging.getLogger('tf1_syncbn.distributed')

__all__ = ['WorkerSession', 'DEFAULT_RESTORE_TIMEOUT']

#: Seconds the other workers allow the chief, at start-up, to restore its
#: checkpoint or run ``init_fn`` (see :class:`WorkerSession`). Generous on
#: purpose: a limit that is too short fails every restart of a job whose
#: restore is slow, so that it can never resume; one that is too long only
#: delays the error when the chief freezes during start-up.
DEFAULT_RESTORE_TIMEOUT = 600.0


class _Watchdog(object):
    """Ends the process when a blocking call is still running after its deadline."""

    def __init__(self):
        self._cond = threading.Condition()
        self._deadline = None
        self._message = None
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name='tf1_syncbn-watchdog',
                                        daemon=True)
        self._thread.start()

    def arm(self, seconds, message):
        with self._cond:
            self._deadline = time.time() + seconds
            self._message = message
            self._cond.notify()

    def disarm(self):
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _watch(self):
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.time()
                if left > 0:
                    self._cond.wait(left)
                    continue
                message = self._message() if callable(self._message) else self._message
                sys.stderr.write('tf1_syncbn: %s\n' % message)
                hard_exit(EXIT_STARTUP_HANG)


_NOISE = ('Graph execution error', 'Detected at node', 'File "', 'Node:', 'Original stack',
          'Recent warning', 'Additional GRPC', '[[', 'The error could be')
_KEYWORDS = ('ollective', 'ocket', 'onnect', 'timed out', 'eer', 'vailable', 'bort', 'ancel')


def _summarize(error):
    """One line of a TensorFlow error: its type and the line that says what happened."""
    lines = [l.strip() for l in str(getattr(error, 'message', error)).splitlines()]
    lines = [l for l in lines if l and not l.startswith(_NOISE) and not l.startswith('From /job')]
    best = next((l for l in lines if any(k in l for k in _KEYWORDS)), lines[0] if lines else '')
    return '%s: %s' % (type(error).__name__, best[:300])


_LOST_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError, tf.errors.CancelledError)


class WorkerSession(object):
    """A session for one worker: start-up checks, identical start, chief-only checkpoints.

    On construction, in this order:

    1. builds, in ``graph``, the initializer, a :func:`broadcast_variables`
       op for ``variables`` (from worker 0) and a ``Saver`` when
       ``checkpoint_dir`` is given;
    2. waits until every peer's server accepts connections
       (:func:`wait_for_peers`; :class:`PeerMissingError` after
       ``cluster.startup_timeout`` seconds, naming the missing workers);
    3. creates the session on ``cluster.target`` and runs the initializer;
    4. on the chief only, restores the latest complete checkpoint in
       ``checkpoint_dir`` when there is one (and ``restore`` is True), or else
       calls ``init_fn(session)`` when given. The candidates are the
       checkpoints the directory's ``checkpoint`` state file lists, newest
       first: one whose files are missing or do not restore (half-written:
       the state file was written, the files not all of them) is skipped
       with a warning; when none of them restores, this raises
       ``RuntimeError`` naming each (it never starts afresh in their place);
    5. runs the broadcast on every worker: every variable, the global step
       and optimizer slots included, becomes the chief's. So only the chief
       needs the checkpoint directory (no shared file system), and no worker
       depends on its seeds. The other workers reach it while the chief is
       still in step 4, so they wait for it up to ``startup_timeout +
       restore_timeout`` seconds, the chief up to ``startup_timeout``; past
       that, :class:`PeerMissingError`.

    Steps 3 to 5 run under a watchdog that ends the process with status
    :data:`EXIT_STARTUP_HANG` when they are still blocked ``hang_timeout +
    restore_timeout`` seconds later (TensorFlow waits forever for a group
    leader that disappeared after step 2, see the module docstring).

    :attr:`start_step` is the global step after start-up (the restored step,
    or 0): a job that feeds data by step resumes exactly where it stopped.
    Under ``python -m tf1_syncbn.launch --max-restarts N`` (which sets
    ``TF1_SYNCBN_RESTART_COUNT``), the chief prints to stderr the step and
    checkpoint it starts from (:func:`tf1_syncbn.launch.restarts.start_line`), which
    the launcher logs for each restart.

    Args:
      cluster: the :class:`Cluster` (one worker works too: no server).
      checkpoint_dir: where the chief saves (:meth:`save`) and restores from;
        None for no checkpoints.
      saver: the ``Saver``; None builds ``tf.compat.v1.train.Saver(max_to_keep=...)``
        over all saveable variables when ``checkpoint_dir`` is given.
      variables: the variables to broadcast; None means every global variable.
      init_op: None runs the global and local variable initializers.
      graph: the graph; None is the default graph.
      max_to_keep: checkpoints kept by the default saver.
      restore: False starts from the initializer (and ``init_fn``) even when
        ``checkpoint_dir`` holds a checkpoint.
      init_fn: called as ``init_fn(session)`` on the chief when nothing was
        restored, after the initializer and before the broadcast (for example
        to load pre-trained weights); the broadcast then carries its values.
      hang_timeout: seconds after which a start-up (steps 3 to 5) that is
        still blocked ends the process, plus ``restore_timeout``; None means
        ``2 * startup_timeout + 30``. Finite, > 0.
      restore_timeout: seconds the chief may spend in step 4 (restoring its
        checkpoint, or ``init_fn``) beyond ``startup_timeout`` before the
        other workers give up on it; finite, >= 0. Default
        :data:`DEFAULT_RESTORE_TIMEOUT` (600 s): too short a limit fails every
        restart of a job whose restore is slow, too long a one only delays the
        error when the chief freezes during start-up.

    Raises:
      ValueError: ``hang_timeout`` or ``restore_timeout`` not a finite number
        of seconds.
      PeerMissingError: see steps 2 and 5; also when this worker was
        restarted and the chief still runs the job's previous start.
      RuntimeError: ``checkpoint_dir`` lists checkpoints, none of which
        restores (step 4).

    Hangs: never; every start-up wait is bounded as above: at most
    ``startup_timeout`` (step 2), then ``hang_timeout + restore_timeout``
    (steps 3 to 5).
    """

    def __init__(self, cluster, checkpoint_dir=None, saver=None, variables=None, init_op=None,
                 graph=None, max_to_keep=5, restore=True, init_fn=None, hang_timeout=None,
                 restore_timeout=DEFAULT_RESTORE_TIMEOUT):
        if hang_timeout is not None:
            hang_timeout = check_seconds(hang_timeout, 'WorkerSession', 'hang_timeout',
                                          allow_zero=False)
        self.restore_timeout = check_seconds(restore_timeout, 'WorkerSession',
                                              'restore_timeout', allow_zero=True)
        self.cluster = cluster
        self._restore = restore
        self._init_fn = init_fn
        self.checkpoint_dir = checkpoint_dir
        self.graph = graph if graph is not None else tf1.get_default_graph()
        self.restored_from = None
        self.hang_limit = (2 * cluster.startup_timeout + 30 if hang_timeout is None
                           else hang_timeout) + self.restore_timeout
        self._session = None
        self._watchdog = None
        with self.graph.as_default():
            if init_op is None:
                init_op = tf.group(tf1.global_variables_initializer(),
                                   tf1.local_variables_initializer())
            if variables is None:
                variables = tf1.global_variables()
            self._broadcast = broadcast_variables(variables, cluster, name='initial_values',
                                                  timeout=self.broadcast_timeout)
            if saver is None and checkpoint_dir is not None:
                saver = tf1.train.Saver(max_to_keep=max_to_keep)
            self._saver = saver
            self._global_step = tf1.train.get_global_step()
        self._init_op = init_op
        self._watchdog = _Watchdog()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def broadcast_timeout(self):
        """Seconds this worker's start-up broadcast waits for the others.

        ``startup_timeout`` on the chief; ``startup_timeout + restore_timeout``
        on the other workers, which wait there while the chief restores.
        """
        if self.cluster.is_chief:
            return self.cluster.startup_timeout
        return self.cluster.startup_timeout + self.restore_timeout

    def _start(self):
        cluster = self.cluster
        me = cluster.describe(cluster.rank)
        started = time.time()
        wait_for_peers(cluster)

        def stuck():
            missing = unreachable_peers(cluster)
            return ('%s: session start-up still blocked after %.0f s (%s). TensorFlow cannot '
                    'interrupt this wait; exiting with status %d.'
                    % (me, time.time() - started,
                       'not answering: ' + ', '.join(missing) if missing else
                       'every peer accepts connections', EXIT_STARTUP_HANG))

        self._watchdog.arm(self.hang_limit, stuck)
        restore_seconds = 0.0
        try:
            self._session = tf1.Session(cluster.target, graph=self.graph, config=cluster.config)
            self._session.run(self._init_op)
            if cluster.is_chief:
                restore_started = time.time()
                if self._restore and self.checkpoint_dir and self._saver is not None:
                    self.restored_from = self._restore_complete(me)
                if self.restored_from is None and self._init_fn is not None:
                    self._init_fn(self._session)
                restore_seconds = time.time() - restore_started
            try:
                self._session.run(self._broadcast)
            except _LOST_ERRORS as e:
                if cluster.num_workers == 1:
                    raise
                missing = unreachable_peers(cluster)
                if cluster.is_chief:
                    within = 'the start-up timeout of %g s' % cluster.startup_timeout
                    if restore_seconds > self.restore_timeout:
                        within += (' (this worker spent %.0f s restoring its checkpoint or in '
                                   'init_fn, more than restore_timeout=%g s, so the others '
                                   'stopped waiting for it: raise restore_timeout)'
                                   % (restore_seconds, self.restore_timeout))
                else:
                    within = ('%g s (startup_timeout=%g s + restore_timeout=%g s allowed for the '
                              'chief\'s restore or init_fn)'
                              % (self.broadcast_timeout, cluster.startup_timeout,
                                 self.restore_timeout))
                raise PeerMissingError(
                    '%s: the other workers did not all join the start-up broadcast within %s '
                    '(%s; %s).'
                    % (me, within, _summarize(e),
                       'not answering now: ' + ', '.join(missing) if missing else
                       'every peer accepts connections'), missing) from None
            except tf.errors.FailedPreconditionError as e:
                if cluster.num_workers == 1 or 'incarnation' not in str(e):
                    raise
                # This worker restarted, and the group leader still runs the job's
                # previous start (it has not noticed the failure yet).
                leader = cluster.describe(0)
                raise PeerMissingError(
                    '%s: %s still runs the previous start of the job: its collective group '
                    'holds this worker as it was before it restarted. It fails within its '
                    'collective timeout, and must restart too; this worker exits so that its '
                    'own restart meets the new one.' % (me, leader), [leader]) from None
        finally:
            self._watchdog.disarm()
        self.start_step = self.global_step() or 0
        if cluster.is_chief and RESTART_COUNT_ENV in os.environ:
            sys.stderr.write(start_line(me, self.start_step, self.restored_from,
                                        self.checkpoint_dir) + '\n')
            sys.stderr.flush()

    def _restore_complete(self, me):
        """Restores the newest checkpoint of ``checkpoint_dir`` that restores; its path or None."""
        state = tf1.train.get_checkpoint_state(self.checkpoint_dir)
        if state is None or not state.model_checkpoint_path:
            return None
        candidates = [state.model_checkpoint_path]
        candidates += [p for p in reversed(state.all_model_checkpoint_paths)
                       if p not in candidates]
        skipped = []
        for path in candidates:
            try:
                self._saver.restore(self._session, path)
            except (ValueError, tf.errors.OpError) as e:    # files missing, or half-written
                skipped.append('%s (%s)' % (path, _summarize(e)))
                continue
            if skipped:
                log.warning('%s: skipped incomplete checkpoints: %s; restored %s instead', me,
                            '; '.join(skipped), path)
            log.info('%s restored %s', me, path)
            return path
        raise RuntimeError(
            '%s: none of the checkpoints that %s lists restores: %s. Restore a complete '
            'checkpoint there, or remove its "checkpoint" file to start afresh.'
            % (me, os.path.join(self.checkpoint_dir, 'checkpoint'), '; '.join(skipped)))

    @property
    def session(self):
        """The underlying ``tf.compat.v1.Session``."""
        return self._session

    def global_step(self):
        """The value of the graph's global step, or None without one."""
        if self._global_step is None:
            return None
        return int(self._session.run(self._global_step))

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """``Session.run``; a failed collective raises :class:`WorkerLostError`.

        Raises:
          WorkerLostError: a collective of this step failed or timed out (a
            worker died, froze, did not run the same step, or paused between
            two steps longer than the step deadline allows). The process's
            collective executor is then aborted: exit (:func:`hard_exit`) and
            restart the job, which resumes from the chief's checkpoint.

        Hangs: never with ``collective_timeout > 0``: the step fails once it
        has lasted ``collective_timeout`` seconds on this worker while a
        collective of it still waits, which includes the time a peer spends
        between its previous step and this one.
        """
        try:
            return self._session.run(fetches, feed_dict, options, run_metadata)
        except _LOST_ERRORS as e:
            if self.cluster.num_workers == 1:
                raise
            missing = unreachable_peers(self.cluster, settle=2.0)
            raise WorkerLostError(
                '%s: a worker was lost during training (%s; %s). Every worker stops: restart '
                'the job, which resumes from the chief\'s latest checkpoint.'
                % (self.cluster.describe(self.cluster.rank), _summarize(e),
                   'not answering: ' + ', '.join(missing) if missing else
                   'every peer still accepts connections, so one is frozen, stopped, failed '
                   'its step, or spent longer between two steps (saving, evaluating) than the '
                   'collective timeout of %g s allows' % self.cluster.collective_timeout)) from None

    def save(self, global_step=None):
        """Saves a checkpoint on the chief; does nothing elsewhere.

        Args:
          global_step: the step in the file name; None reads the global step.

        Returns:
          The checkpoint path on the chief, None on the other workers (or
          without ``checkpoint_dir``).
        """
        if not self.cluster.is_chief or self._saver is None or not self.checkpoint_dir:
            return None
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        step = self.global_step() if global_step is None else global_step
        return self._saver.save(self._session, os.path.join(self.checkpoint_dir, 'model.ckpt'),
                                global_step=step)

    def close(self):
        """Closes the session and stops the watchdog thread."""
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
