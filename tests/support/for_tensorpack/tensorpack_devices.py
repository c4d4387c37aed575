"""tensorpack's multi-GPU trainers on virtual CPUs: the one override the tests make.

tensorpack's ``DataParallelBuilder`` hard-codes ``'/gpu:<k>'`` for tower ``k``.
This machine has no GPU, so :func:`towers_on_virtual_cpus` wraps
``build_on_towers`` to put tower ``k`` on the virtual CPU ``/cpu:<k>`` instead
(its compute device, and the variable devices of the parameter-server device
setter). Nothing else of tensorpack is changed. Imports only tensorpack.
"""


def towers_on_virtual_cpus():
    """Makes tensorpack's trainers build tower ``k`` on ``/cpu:<k>`` (idempotent)."""
    from tensorpack.graph_builder import training as tp_training  # noqa: PLC0415
    builder = tp_training.DataParallelBuilder
    if getattr(builder.build_on_towers, '_on_virtual_cpus', False):
        return
    original = builder.build_on_towers

    def on_cpu(device):
        if isinstance(device, str):
            return device.replace('/gpu:', '/cpu:')
        device.worker_device = on_cpu(device.worker_device)
        device.ps_devices = [on_cpu(d) for d in device.ps_devices]
        return device

    def build_on_towers(towers, func, devices=None, use_vs=None):
        devices = (['/cpu:%d' % t for t in towers] if devices is None
                   else [on_cpu(d) for d in devices])
        return original(towers, func, devices=devices, use_vs=use_vs)

    build_on_towers._on_virtual_cpus = True
    builder.build_on_towers = staticmethod(build_on_towers)
