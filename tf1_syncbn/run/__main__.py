"""``python -m tf1_syncbn.run [options] script.py [args...]``.

The package starts the runner before it imports TensorFlow
(``tf1_syncbn._cli.start_early``); this module is reached only where it
could not (Python 3.9, which has no ``sys.orig_argv``, or
``runpy.run_module``). It starts the script the same way, in a new
interpreter image (:func:`tf1_syncbn.run.startup.exec_runner`).
"""

import sys

from tf1_syncbn.run.startup import exec_runner

if __name__ == '__main__':
    exec_runner(sys.argv[1:])
