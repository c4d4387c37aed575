"""``python -m tf1_syncbn.kernels``: compile the CPU kernels into the cache ahead of time.

For images and CI: run it once after installing, and the first synchronized
layer of a training job loads the cached library instead of compiling (about
20 s). Prints the library's path; exits with status 1, and says why, when no
compiler works (the layers would then fall back to TensorFlow's stock kernels).

Usage: ``python -m tf1_syncbn.kernels [--force]`` (``--force``: compile even when a build is
cached).
"""

import os
import sys

from tf1_syncbn._cli import kernels_parser

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def main(argv=None):
    args = kernels_parser().parse_args(argv)
    from tf1_syncbn import kernels  # noqa: PLC0415 - after the log level is set
    try:
        path = kernels.build(force=args.force)
        import tensorflow as tf  # noqa: PLC0415
        tf.load_op_library(path)
    except Exception as e:  # noqa: BLE001 - report any failure, exit non-zero
        print("tf1_syncbn: the CPU kernels could not be built (%s); layers will use "
              "TensorFlow's stock kernels." % e, file=sys.stderr)
        return 1
    print('tf1_syncbn: CPU kernels ready: %s' % path)
    return 0


if __name__ == '__main__':
    sys.exit(main())
