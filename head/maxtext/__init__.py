"""MaxText's own pre-training with mtc as its multi-tier checkpoint manager:
``python3 -m mtc.head.maxtext <the arguments of python3 -m maxtext.trainers.pre_train.train>``.

The hooks into MaxText and the run (``launcher``), the data iterator's position in mtc's steps
(``data``) and the XLA compilation cache a restart finds (``compile_cache``). Nothing here imports
MaxText until the launcher runs.
"""

# What the supervisor's standby imports while it waits (``python3 -m mtc.head.maxtext``): what the
# launcher and MaxText's training import, short of a device or a backend (MaxText's train module
# initialises neither when it is imported).
WARM = ("jax", "numpy", "mtc.head.maxtext.launcher", "mtc.head.manager", "mtc.head.maxtext.compile_cache",
        "maxtext.trainers.pre_train.train")
