"""``python3 -m mtc.head.maxtext``: the MaxText launcher (``mtc.head.maxtext.launcher``), under the head
pod's supervisor (``mtc.head.supervisor``): a training process that dies is replaced at once by a
standby that has already imported JAX, MaxText and mtc. ``MTC_SUPERVISOR=0``: the launcher runs in
this process, as a plain program (a failure then ends it, and the pod restarts)."""

import logging
import os
import sys

from mtc.head import supervisor
from mtc.head.maxtext import WARM


if supervisor.ENV_PROMOTION in os.environ or not supervisor.enabled():
    from mtc.head.maxtext.launcher import main

    sys.exit(main())
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
try:
    pod = supervisor.Supervisor(["-m", "mtc.head.maxtext", *sys.argv[1:]], WARM)
except supervisor.SupervisorConfigError as e:
    print(f"mtc: {e}", file=sys.stderr)
    sys.exit(2)
sys.exit(pod.run())
