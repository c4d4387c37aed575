"""Tower devices and session configs: virtual CPUs, or GPUs split into logical GPUs when needed.

``--device cpu`` (the default of the benchmark scripts) is what they always
did: towers on ``'/cpu:<i>'`` with :func:`tower.virtual_cpu_config`.
``--device gpu`` puts tower ``i`` on ``'/gpu:<i>'``. With fewer physical GPUs
than towers, every physical GPU is split into ``k`` logical GPUs
(``k = ceil(towers / physical GPUs)``), of equal memory, in two places that
must agree:

* the process's TensorFlow configuration
  (``tf.config.set_logical_device_configuration``), from which the library
  counts the GPUs a tower may name (:func:`tf1_syncbn.backends.local_gpu_count`);
* the TF1 session config, ``gpu_options.experimental.virtual_devices``
  (a session given a config does not read the process's configuration).

TensorFlow fixes a process's GPU devices when it first initializes them
(the first session, or the first eager op): split them before that, in a
process of their own. Towers are spread over the physical GPUs first (tower
``i`` on physical GPU ``i % P``). Towers that share a physical GPU share its
compute and memory bandwidth, so their timings are not those of separate
GPUs; NCCL needs distinct physical GPUs (its communicators refuse two ranks
on one GPU), the collective ops do not.

TensorFlow is imported inside the functions: ``tools/gpu_check.py`` and the
tests read the pure parts without it.
"""

import collections
import math

from _machine import query_gpus

#: Memory of each logical GPU (MiB) when the free memory is unknown.
FALLBACK_MEMORY_MB = 1024
#: The share of a GPU's free memory given to its logical GPUs together.
MEMORY_SHARE = 0.8

#: Where the towers go: ``devices`` (one string per tower), ``config`` (the
#: session ``ConfigProto``), ``notes`` (lines to print: how GPUs were split),
#: ``kind`` (``'cpu'`` or ``'gpu'``).
TowerSetup = collections.namedtuple('TowerSetup', ['devices', 'config', 'notes', 'kind'])


def split_factor(towers, physical):
    """Logical GPUs per physical GPU for ``towers`` towers: ``ceil(towers / physical)``."""
    if physical < 1:
        raise ValueError('split_factor: no physical GPU')
    return max(1, int(math.ceil(towers / float(physical))))


def logical_memory_mb(split, cap_mb, free_mb=None):
    """Memory of each of ``split`` logical GPUs of one physical GPU (MiB).

    ``MEMORY_SHARE`` of ``free_mb`` (the smallest free memory of the GPUs,
    from ``nvidia-smi``) split evenly, at most ``cap_mb``; without
    ``free_mb``, ``min(cap_mb, FALLBACK_MEMORY_MB)``.
    """
    if free_mb is None:
        return min(cap_mb, FALLBACK_MEMORY_MB)
    return max(1, min(cap_mb, int(free_mb * MEMORY_SHARE / split)))


def tower_gpus(towers, physical, split):
    """Logical GPU index of each tower: tower ``i`` on physical GPU ``i % physical``.

    TensorFlow numbers the logical GPUs of physical GPU ``p`` from ``p *
    split``.
    """
    if towers > physical * split:
        raise ValueError('tower_gpus: %d towers do not fit on %d x %d logical GPUs'
                         % (towers, physical, split))
    return [(i % physical) * split + i // physical for i in range(towers)]


def gpu_session_config(physical, split, memory_mb, soft_placement=False):
    """A ``ConfigProto`` for ``physical`` GPUs, each split into ``split`` logical ones.

    Args:
      physical: the number of physical GPUs the process sees.
      split: logical GPUs per physical GPU; 1 leaves them whole (with
        ``allow_growth``).
      memory_mb: memory of each logical GPU (MiB), when ``split > 1``.
      soft_placement: ``allow_soft_placement``.
    """
    import tensorflow as tf  # noqa: PLC0415 - see the module docstring
    config = tf.compat.v1.ConfigProto(allow_soft_placement=soft_placement)
    if split > 1:
        for _ in range(physical):
            config.gpu_options.experimental.virtual_devices.add(
                memory_limit_mb=[float(memory_mb)] * split)
    else:
        config.gpu_options.allow_growth = True
    return config


def split_physical_gpus(split, memory_mb):
    """Splits every physical GPU into ``split`` logical GPUs in this process's configuration.

    Raises:
      ValueError: when the GPUs were already initialized (TensorFlow's
        ``RuntimeError``), saying so.
    """
    import tensorflow as tf  # noqa: PLC0415 - see the module docstring
    logical = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)] * split
    try:
        for gpu in tf.config.list_physical_devices('GPU'):
            tf.config.set_logical_device_configuration(gpu, logical)
    except RuntimeError as e:
        raise ValueError('cannot split the GPUs into logical GPUs: this process initialized '
                         'them already (%s). Split them first thing, in a fresh process.' % e)


def no_gpu_message():
    """Why TensorFlow sees no GPU here, and what to do, in one paragraph."""
    import tensorflow as tf  # noqa: PLC0415 - see the module docstring
    if not tf.test.is_built_with_cuda():
        why = ('this TensorFlow is a CPU-only build (tensorflow-cpu, or a build without '
               "CUDA): install tensorflow[and-cuda] (pip install -e '.[gpu]'), or run make "
               'gpu-check, which sets up .venv-gpu')
    else:
        why = ('it is built with CUDA, but no GPU is visible: check nvidia-smi, the NVIDIA '
               'driver against the CUDA version TensorFlow needs, and CUDA_VISIBLE_DEVICES')
    return "TensorFlow %s sees no GPU (tf.config.list_physical_devices('GPU') is empty): %s." \
        % (tf.__version__, why)


def on_devices(setup):
    """``' on /gpu:0, /gpu:1'`` for GPU towers; '' on CPUs (the output as it always was)."""
    return ' on ' + ', '.join(setup.devices) if setup.kind == 'gpu' else ''


def towers_on(device, towers, memory_cap_mb=4096, soft_placement=True):
    """Where ``towers`` towers go with ``--device device``.

    Args:
      device: ``'cpu'`` (virtual CPUs, :func:`tower.virtual_cpu_config`) or
        ``'gpu'``.
      towers: the number of towers, at least 1.
      memory_cap_mb: the most memory of one logical GPU (MiB) when GPUs are
        split.
      soft_placement: ``allow_soft_placement`` on GPUs (ops without a GPU
        kernel then run on the CPU).

    Returns:
      A :class:`TowerSetup`.

    Raises:
      ValueError: an unknown device, a bad tower count, no GPU (saying why,
        :func:`no_gpu_message`), or GPUs already initialized.
    """
    if device not in ('cpu', 'gpu'):
        raise ValueError("--device must be 'cpu' or 'gpu', got %r" % (device,))
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 1:
        raise ValueError('--towers must be a positive int, got %r' % (towers,))
    import tensorflow as tf  # noqa: PLC0415 - see the module docstring
    if device == 'cpu':
        from tower import virtual_cpu_config  # noqa: PLC0415
        return TowerSetup(['/cpu:%d' % i for i in range(towers)], virtual_cpu_config(towers),
                          [], 'cpu')
    physical = len(tf.config.list_physical_devices('GPU'))
    if not physical:
        raise ValueError('--device gpu: ' + no_gpu_message())
    split = split_factor(towers, physical)
    notes = []
    memory_mb = None
    if split > 1:
        gpus = query_gpus() or []
        free = [g.memory_free_mb for g in gpus if g.memory_free_mb is not None]
        memory_mb = logical_memory_mb(split, memory_cap_mb, min(free) if free else None)
        split_physical_gpus(split, memory_mb)
        notes.append('%d towers on %d physical GPU%s: each split into %d logical GPUs of %d MiB '
                     '(towers sharing a GPU share its compute: not the timings of %d GPUs)'
                     % (towers, physical, '' if physical == 1 else 's', split, memory_mb,
                        towers))
    devices = ['/gpu:%d' % i for i in tower_gpus(towers, physical, split)]
    return TowerSetup(devices, gpu_session_config(physical, split, memory_mb, soft_placement),
                      notes, 'gpu')


def parse_towers(parser, argv, towers=None,
                 device_help='tower devices: virtual CPUs (default) or GPUs'):
    """Adds ``--device`` to ``parser``, parses ``argv`` and places the towers there.

    Args:
      parser: the script's ``argparse.ArgumentParser``, with every other option.
      argv: the arguments (None: ``sys.argv[1:]``).
      towers: the number of towers; None: the ``--towers`` option's.
      device_help: the help of ``--device``.

    Returns:
      ``(args, setup)``: the parsed arguments and :func:`towers_on`'s
      :class:`TowerSetup`.

    Raises:
      SystemExit: a wrong argument, or towers that cannot go there
        (``parser.error``, with :func:`towers_on`'s reason).
    """
    parser.add_argument('--device', choices=('cpu', 'gpu'), default='cpu', help=device_help)
    args = parser.parse_args(argv)
    try:
        return args, towers_on(args.device, args.towers if towers is None else towers)
    except ValueError as e:
        parser.error(str(e))
