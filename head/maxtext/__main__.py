"""``python3 -m mtc.head.maxtext``: the MaxText launcher (``mtc.head.maxtext.launcher``)."""

import sys

from mtc.head.maxtext.launcher import main

sys.exit(main())
