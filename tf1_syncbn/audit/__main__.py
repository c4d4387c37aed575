"""``python -m tf1_syncbn.audit MODEL.meta``: :func:`tf1_syncbn.audit.main`."""

import sys

from tf1_syncbn.audit.command import main

if __name__ == '__main__':
    sys.exit(main())
