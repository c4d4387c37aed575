"""``python -m tf1_syncbn.launch``, or ``python path/to/tf1_syncbn/launch`` (without the package).

Both run :func:`tf1_syncbn.launch.main`; the second imports neither the
package nor TensorFlow (the interpreter runs this folder's ``__main__.py``,
which imports the modules next to it by their own names).
"""

import sys

if __package__:
    from tf1_syncbn.launch.command import main
else:   # python path/to/tf1_syncbn/launch: the modules next to this file, without the package
    from command import main

if __name__ == '__main__':
    sys.exit(main())
