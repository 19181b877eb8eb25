"""``python3 -m mtc.head.maxtext``: the MaxText launcher (``mtc.head.maxtext.launcher``), under the head
pod's supervisor (``mtc.head.supervisor``): a training process that dies is replaced at once by a
standby that has already imported JAX, MaxText and mtc. ``MTC_SUPERVISOR=0``: the launcher runs in
this process, as a plain program (a failure then ends it, and the pod restarts)."""

import logging
import os
import sys

from mtc.head import supervisor

# What a standby imports while it waits: everything the launcher and MaxText's training import, short
# of a device or a backend (MaxText's train module initialises neither when imported).
WARM = ("jax", "numpy", "mtc.head.maxtext.launcher", "mtc.head.manager", "mtc.head.maxtext.compile_cache",
        "maxtext.trainers.pre_train.train")

if supervisor.ENV_PROMOTION in os.environ or not supervisor.enabled():
    from mtc.head.maxtext.launcher import main

    sys.exit(main())
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(supervisor.Supervisor(["-m", "mtc.head.maxtext", *sys.argv[1:]], WARM).run())
