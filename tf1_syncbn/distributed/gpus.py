"""Which GPUs each worker takes: its local rank among the workers of its host.

Several workers on one machine must not share GPUs. :func:`local_rank` tells
a worker's position among the workers of its own host, and
:func:`select_gpus` gives it GPUs ``local_rank * T`` to ``local_rank * T +
T - 1`` (or those ``CUDA_VISIBLE_DEVICES`` or the user's config already chose)
as the session's ``visible_device_list``.
"""

__all__ = ['local_rank', 'select_gpus']


def _parse_host(address):
    host = address.rpartition(':')[0] if ':' in address else address
    return host.strip('[]')


_LOOPBACK = ('localhost', '127.0.0.1', '::1')


def _host_of(address):
    """The host part of ``address``, lower-cased; every loopback spelling is ``'localhost'``."""
    host = _parse_host(address).lower()
    return 'localhost' if host in _LOOPBACK else host


def local_rank(addresses, rank):
    """The position of worker ``rank`` among the workers on its own host.

    Workers are on the same host when the host parts of their addresses are
    spelled the same (case-insensitive; ``localhost``, ``127.0.0.1`` and
    ``::1`` count as one). Names are not resolved: ``h0`` and its IP address
    count as two hosts.

    Args:
      addresses: ``host:port`` of every worker, in rank order (empty for one
        worker).
      rank: the worker's index in ``addresses``.

    Returns:
      An int: 0 for the first worker of its host, 1 for the second, ...
    """
    if not addresses:
        return 0
    host = _host_of(addresses[rank])
    return sum(1 for address in addresses[:rank] if _host_of(address) == host)


def select_gpus(towers, worker, local, config, environ, physical_gpus):
    """The ``visible_device_list`` of a GPU worker; raises when it cannot have its GPUs.

    Args:
      towers: GPUs this worker needs (one per tower).
      worker: ``'worker <rank> (<address>)'``, for messages.
      local: this worker's local rank (:func:`local_rank`).
      config: the user's ``ConfigProto`` or None; a ``visible_device_list``
        set there is kept.
      environ: the environment (``CUDA_VISIBLE_DEVICES``).
      physical_gpus: how many GPUs this process sees.

    Returns:
      The ``visible_device_list`` string.
    """
    fixes = ('Give each worker GPUs of its own: set CUDA_VISIBLE_DEVICES per worker (python -m '
             'tf1_syncbn.launch --gpus-per-worker %d does), start fewer workers on this host, '
             'or use fewer towers.' % towers)
    user_list = config.gpu_options.visible_device_list if config is not None else ''
    if user_list:
        try:
            chosen = [int(i) for i in user_list.split(',')]
        except ValueError:
            raise ValueError('setup_cluster: config.gpu_options.visible_device_list=%r is not a '
                             'comma-separated list of GPU indices.' % (user_list,)) from None
        source = 'config.gpu_options.visible_device_list=%r' % user_list
        if len(chosen) < towers:
            raise ValueError('setup_cluster: %s with towers=%d needs %d GPUs, but %s lists %d.'
                             % (worker, towers, towers, source, len(chosen)))
    elif 'CUDA_VISIBLE_DEVICES' in environ:
        # The launcher (or the user) already chose this worker's GPUs.
        chosen = list(range(towers))
        source = 'CUDA_VISIBLE_DEVICES=%r' % environ['CUDA_VISIBLE_DEVICES']
    else:
        chosen = list(range(local * towers, (local + 1) * towers))
        source = ('local rank %d: worker %d on its host, so GPUs %d to %d'
                  % (local, local, chosen[0], chosen[-1]))
    needed = max(chosen) + 1
    if physical_gpus < needed:
        if physical_gpus == 0:
            fixes = ('A TensorFlow build without GPU support sees none, and so does a process '
                     'whose CUDA_VISIBLE_DEVICES names a GPU that does not exist (CUDA then '
                     'hides the GPUs listed after it). ' + fixes)
        raise ValueError(
            "setup_cluster: %s with device_type='GPU' and towers=%d needs %d GPUs (%s), but "
            "this process sees %d. %s" % (worker, towers, needed, source, physical_gpus, fixes))
    return ','.join(str(i) for i in chosen)
