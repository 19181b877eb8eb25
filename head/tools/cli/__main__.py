"""``python -m mtc.head.tools.cli ...``: the same as ``mtc ...``."""

import sys

from mtc.head.tools.cli.main import main

sys.exit(main())
