"""``python -m mtc.sidecar serve --root DIR --host-id ID ...``: run a sidecar daemon."""

import sys

from mtc.sidecar.daemon import main

if __name__ == "__main__":
    sys.exit(main())
