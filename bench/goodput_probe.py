"""One training process of the goodput benchmark: MaxText's pre-training, with time marks.

    python bench/goodput_probe.py mtc|orbax <MaxText's train arguments>

``mtc`` runs exactly what ``python3 -m mtc.head.maxtext`` runs (``mtc.head.maxtext.launcher.main``);
``orbax`` runs MaxText's own ``maxtext.trainers.pre_train.train`` main (its standard Orbax
checkpointing). Nothing of either is changed: the probe only wraps a few MaxText functions to
note when they start and end, and appends one JSON line per mark to ``$GOODPUT_MARKS``
(``{"mark": NAME, "t": unix time, ...}``), so that ``bench_goodput.py`` can split each
recovery into stages:

- ``start``: the interpreter is up and runs this file;
- ``imported``: jax, MaxText's train module (and, for mtc, the launcher's hooks) are imported;
- ``initialized``: MaxText's ``initialize`` returned (config parsed, JAX's devices up);
- ``restore_begin`` / ``restore_end``: MaxText's ``load_state_if_possible`` (its restore, or the
  finding that there is nothing to restore);
- ``compiled``: the train step's ahead-of-time compilation returned;
- ``step``: MaxText logged ``completed step: N`` (``step`` = N);
- ``mtc_restored``: mtc logged its restore's report (``line``: what follows ``mtc: ``);
- ``maxtext_restored``: MaxText's standard checkpointing logged its restore (``line``);
- ``elastic_event`` / ``slices_ready`` (with ``GOODPUT_ELASTIC=1``, MaxText's elastic mode on CPU
  through ``bench/pathways_cpu.py``'s stand-ins for Pathways): an error reached pathwaysutils'
  elastic retry; the retry has its slices and starts an attempt (``initialized`` and the marks
  after it then come again, in the same process);
- ``final``: the train loop returned: ``digest`` is a SHA-256 over every leaf of the final train
  state (its path, dtype, shape and bytes, in tree order), for the bit-for-bit check; ``bytes``
  its size.
"""

from __future__ import annotations

import json
import os
import sys
import time

_T_START = time.time()
_MARKS = os.environ.get("GOODPUT_MARKS")


def mark(name: str, **fields) -> None:
    if not _MARKS:
        return
    with open(_MARKS, "a") as f:
        f.write(json.dumps({"mark": name, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")


def state_digest(state) -> dict:
    """SHA-256 over the state's leaves: path, dtype, shape and raw bytes (typed keys as their data);
    and the state's size in bytes."""
    import hashlib

    import jax
    import numpy as np

    h, nbytes = hashlib.sha256(), 0
    leaves = jax.tree_util.tree_leaves_with_path(state)
    for path, leaf in leaves:
        if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.asarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        nbytes += a.nbytes
    return {"digest": h.hexdigest(), "bytes": nbytes}


def _wrap(module, name: str, before: str | None, after: str | None, result=None) -> None:
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        if before:
            mark(before)
        out = original(*args, **kwargs)
        if after:
            mark(after, **(result(out, *args, **kwargs) if result else {}))
        return out

    setattr(module, name, wrapped)


def _install_marks() -> None:
    import logging

    from maxtext.common import checkpointing
    from maxtext.trainers.pre_train import train
    from maxtext.utils import max_utils

    _wrap(train, "initialize", None, "initialized")
    _wrap(checkpointing, "load_state_if_possible", "restore_begin", "restore_end")

    original_stats = max_utils.print_compiled_memory_stats

    def print_stats(compiled_stats, prefix: str = ""):
        mark("compiled", prefix=prefix)
        return original_stats(compiled_stats, prefix=prefix)

    max_utils.print_compiled_memory_stats = print_stats
    _wrap(train, "train_loop", None, "final", result=lambda state, *a, **k: state_digest(state))

    class Steps(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if msg.startswith("completed step: "):
                mark("step", step=int(msg.split(",")[0].split(":")[1]))
            elif msg.startswith("mtc: restored step "):
                mark("mtc_restored", line=msg[len("mtc: "):])
            elif "restoring from this run's directory step" in msg:
                mark("maxtext_restored", line=msg)

    logging.getLogger().addHandler(Steps(level=logging.INFO))


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("mtc", "orbax"):
        print("usage: goodput_probe.py mtc|orbax <MaxText's train arguments>", file=sys.stderr)
        return 2
    # A promoted standby says when its warm imports were done: a failure before then waited for them.
    promoted = json.loads(os.environ.get("MTC_SUPERVISOR_PROMOTION") or "{}")
    mark("start", t_interp=_T_START, **({"warm_at": promoted["warm_at"]} if "warm_at" in promoted else {}))
    mode, args = argv[1], [argv[0], *argv[2:]]
    import jax  # noqa: F401  (counted in the import stage, as MaxText's train module imports it)

    if mode == "mtc":
        elastic = os.environ.get("GOODPUT_ELASTIC") == "1"
        if elastic:  # Pathways' slice map and health check, stood in for on CPU (bench/pathways_cpu.py)
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import pathways_cpu

            pathways_cpu.install(mark)
        from mtc.head.maxtext import launcher

        launcher.install()
        _install_marks()
        if elastic:
            pathways_cpu.install_maxtext_marks(mark)
        mark("imported")
        return launcher.main(args)
    from absl import app

    from maxtext.trainers.pre_train import train

    _install_marks()
    mark("imported")
    app.run(train.main, argv=args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
