"""A process that skips a synchronized layer, or dies, ends the Horovod job with an error.

``hang_worker.py`` under ``horovodrun --gloo``, 2 processes, after one
successful step:

* ``skip``: process 1 runs the next step with ``is_training=False``: it
  skips the layer's all-reduce and waits in the gradient all-reduces, while
  process 0 waits in the layer's (a deadlock). With ``horovodrun
  --stall-check-warning-time-seconds 2 --stall-check-shutdown-time-seconds
  4``, Horovod's stall inspector names the layer's all-reduce and the
  missing process, and shuts Horovod down: the step fails on the processes
  with "Horovod has been shut down", within seconds. (Horovod 0.28.1's Gloo
  controller needs the ``gloo-stall`` patch of ``tools/build_horovod.sh``
  for that: unpatched, the inspector sees no missing rank and the job waits
  forever.)
* ``die``: process 1 exits with status 3; ``horovodrun`` terminates process
  0, which waits for it, and fails naming process 1.

Without the stall shutdown configured, ``HorovodBackend`` warns at graph build
that a skipped layer would wait forever.
"""

import re

import pytest

from .horovod_run import horovodrun

# Horovod's stall inspector and horovodrun's handling of a dead process do not
# depend on the TF behaviour: the TF2-behaviour pass runs these (once).
pytestmark = [pytest.mark.timeout(400),
              pytest.mark.once(reason="Horovod's stall shutdown and horovodrun's process "
                                      'handling, whichever the TF behaviour')]

#: Horovod's stall inspector: warn after 2 s, shut down after 4 s.
STALL = ['--stall-check-warning-time-seconds', '2', '--stall-check-shutdown-time-seconds', '4']
#: Seconds within which the job with a dead process must end, start-up included
#: (its workers' own hang dump comes at 240 s: a process left waiting would pass it).
BOUND = 120


def test_a_process_that_skips_the_layer_ends_the_step_with_an_error():
    job = horovodrun('hang_worker.py', ['skip'], horovodrun_args=STALL,
                     env={'HANG_SECONDS': '150'}, timeout=300)
    out = job.output
    assert job.returncode not in (0, None), job.tail()
    assert 'Timeout (0:02:30)' not in out, 'a process hung until its own dump:\n' + job.tail()
    assert out.count('WARNED: none') == 2, job.tail()        # the stall shutdown is set
    # The stall inspector names the missing process and the layer's all-reduce.
    # (Each line of a process's output comes prefixed by horovodrun: "[0]<stderr>:".)
    assert re.search(r'Missing ranks:(.*\n){1,3}.*1!?: \[[^\]]*tf1_syncbn\.bn_0\.forward\]', out), \
        job.tail()
    assert 'is stalled for longer than 4 seconds. Will shutdown.' in out, job.tail()
    failed = re.findall(r'rank (\d): step 1 failed after ([0-9.]+) s: (\w+): (.*)', out)
    assert failed, job.tail()
    for rank, seconds, _, message in failed:
        assert float(seconds) < 30, (rank, seconds)
        assert 'Horovod has been shut down' in message, message
    assert 'step 1 done' not in out


def test_a_process_that_dies_ends_the_job():
    job = horovodrun('hang_worker.py', ['die'], env={'HANG_SECONDS': '240'}, timeout=300)
    out = job.output
    assert job.returncode not in (0, None), job.tail()
    assert job.seconds < BOUND, job.tail()
    assert 'Process 1 exit with status code 3' in out, job.tail()
    assert 'rank 0: step 1 done' not in out
    # No stall shutdown configured: the backend said what a skipped layer would do.
    assert out.count("WARNED: sync_statistics='horovod': Horovod's stall shutdown is off") == 2, \
        job.tail()
