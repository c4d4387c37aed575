"""What machine the figures come from: the CPU, and the GPUs as ``nvidia-smi`` lists them.

Standard library only, so that ``tools/gpu_check.py`` can use it before any
environment with TensorFlow exists. The benchmark scripts print these lines
with their figures (``_timing.machine_line`` for the CPU and TensorFlow,
:func:`gpu_line` on GPU runs).
"""

import collections
import os
import platform
import re
import shutil
import subprocess

#: The ``nvidia-smi --query-gpu`` fields read, in order.
QUERY_FIELDS = ('index', 'name', 'memory.total', 'memory.free', 'driver_version')

#: One GPU: its index, model name, total and free memory (MiB; None when
#: nvidia-smi cannot tell) and the driver version.
Gpu = collections.namedtuple('Gpu', ['index', 'name', 'memory_total_mb', 'memory_free_mb',
                                     'driver'])


def cpu_model():
    """The CPU model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_line():
    """``'<CPU model>, <n> cores'``."""
    return '%s, %d cores' % (cpu_model(), os.cpu_count() or 0)


def run_nvidia_smi(args, nvidia_smi='nvidia-smi', timeout=60):
    """Runs ``nvidia-smi`` with ``args``.

    Returns:
      ``(status, output)``: ``status`` is ``'missing'`` (not on ``PATH``, or
      not executable), ``'failed'`` (it ran and exited non-zero, or did not
      finish within ``timeout`` seconds) or ``'ok'``; ``output`` is its
      stdout and stderr together, stripped.
    """
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return 'missing', ''
    try:
        done = subprocess.run([exe] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 'failed', '%s %s did not finish in %d s' % (nvidia_smi, ' '.join(args), timeout)
    except OSError as e:
        return 'missing', str(e)
    return ('ok' if done.returncode == 0 else 'failed'), done.stdout.strip()


def parse_gpu_list(text):
    """The GPU lines of ``nvidia-smi -L`` (``GPU 0: <name> (UUID: ...)``); MIG lines left out."""
    return [line.strip() for line in text.splitlines() if re.match(r'\s*GPU \d+:', line)]


def _mib(text):
    try:
        return int(float(text))
    except ValueError:
        return None     # '[N/A]', '[Not Supported]'


def parse_gpu_query(text):
    """Parses ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits``.

    Returns:
      A list of :class:`Gpu`; lines that do not parse are left out. A model
      name may contain commas: the index is the first field, the other three
      the last ones.
    """
    gpus = []
    for line in text.splitlines():
        if line.count(',') < len(QUERY_FIELDS) - 1:
            continue
        index, rest = line.split(',', 1)
        name, total, free, driver = rest.rsplit(',', 3)
        if not index.strip().isdigit():
            continue
        gpus.append(Gpu(int(index), name.strip(), _mib(total.strip()), _mib(free.strip()),
                        driver.strip()))
    return gpus


def query_gpus(nvidia_smi='nvidia-smi'):
    """The GPUs ``nvidia-smi`` reports, as :class:`Gpu`; None when it is missing or fails."""
    status, output = run_nvidia_smi(
        ['--query-gpu=' + ','.join(QUERY_FIELDS), '--format=csv,noheader,nounits'], nvidia_smi)
    return parse_gpu_query(output) if status == 'ok' else None


def driver_cuda_version(nvidia_smi='nvidia-smi'):
    """The newest CUDA version the driver supports (``nvidia-smi``'s header), or ''."""
    status, output = run_nvidia_smi([], nvidia_smi)
    found = re.search(r'CUDA Version:\s*([0-9.]+)', output) if status == 'ok' else None
    return found.group(1) if found else ''


def describe_gpus(gpus):
    """``'2 x NVIDIA A100-SXM4-40GB (40960 MiB), driver 550.54.15'`` (models grouped)."""
    if not gpus:
        return 'no GPU'
    groups = collections.OrderedDict()
    for gpu in gpus:
        groups.setdefault((gpu.name, gpu.memory_total_mb), []).append(gpu)
    parts = ['%d x %s%s' % (len(members), name,
                            ' (%d MiB)' % memory if memory is not None else '')
             for (name, memory), members in groups.items()]
    drivers = sorted({gpu.driver for gpu in gpus if gpu.driver})
    return '%s, driver %s' % (' + '.join(parts), ', '.join(drivers) or 'unknown')


def gpu_line(gpus=None):
    """One line naming the GPUs (``nvidia-smi``), for the output of a GPU run."""
    if gpus is None:
        gpus = query_gpus()
    if gpus is None:
        return 'GPUs: nvidia-smi is not available here'
    return 'GPUs: %s' % describe_gpus(gpus)


def slug(text):
    """``text`` as a file-name part: lower case, runs of other characters as one ``-``."""
    return re.sub(r'[^a-z0-9.]+', '-', text.lower()).strip('-.') or 'unknown'
