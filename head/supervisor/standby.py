"""A child of the supervisor (``mtc.head.supervisor``): imports ``--warm`` modules, then waits for the
word to run the training program.

    python -m mtc.head.supervisor.standby --parent-pid PID --warm jax,maxtext.trainers.pre_train.train \\
        -- -m mtc.head.maxtext <args>

It dies with the supervisor. Its stdin carries one line: ``go {record}`` (run the program: ``-m module``
as ``python -m`` would, or a script path, with ``sys.argv`` set as for a new process), or nothing (EOF:
the supervisor stopped it; it exits 0). A warm module that fails to import is logged and left to the
program, which then meets the same error itself.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

from mtc.head import supervisor
from mtc.shared.lifeline import die_with_parent

def _args(argv: list[str]) -> tuple[int, list[str], list[str]]:
    parent, warm = 0, []
    i = 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--parent-pid":
            parent = int(argv[i + 1])
        elif argv[i] == "--warm":
            warm = [m for m in argv[i + 1].split(",") if m]
        i += 2
    return parent, warm, argv[i + 1:]


def main(argv: list[str]) -> int:
    parent, warm, target = _args(argv)
    if parent:
        die_with_parent(parent, "this training process")
    t0 = time.monotonic()
    for module in warm:
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 - the program meets it again, with its own message
            print(f"mtc: standby: importing {module} failed ({type(e).__name__}: {e}); left to the program",
                  file=sys.stderr, flush=True)
    imported = sorted(sys.modules)
    warm_at = time.time()  # its imports done: a go that came before waited for them
    line = sys.stdin.buffer.readline()
    if not line.startswith(b"go"):
        return 0  # stopped by the supervisor
    record = json.loads(line[2:].decode() or "{}")
    record["warm"] = imported
    record["warm_s"] = time.monotonic() - t0
    record["warm_at"] = warm_at
    supervisor.set_promotion(record)
    os.environ[supervisor.ENV_PROMOTION] = json.dumps({k: v for k, v in record.items() if k != "warm"})
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # the program's stdin: as a pod's (nothing)
    if record.get("restart") and record.get("standby"):
        print(f"mtc: supervisor: promoted standby pid {os.getpid()} (restart {record['restart']}; {len(imported)} "
              f"modules imported before it was told to go)", file=sys.stderr, flush=True)
    elif record.get("restart"):
        print(f"mtc: supervisor: restarted in place as pid {os.getpid()} (restart {record['restart']}; no standby: "
              "it imported everything after the failure)", file=sys.stderr, flush=True)
    if target[:1] == ["-m"]:
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        runpy.run_path(target[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
