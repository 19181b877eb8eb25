"""``python -m mtc.head.supervisor [--warm m1,m2] -- (-m module | script.py) args...``: run a training
program under the supervisor (``mtc.head.supervisor``). ``python -m mtc.head.maxtext`` does this itself."""

import logging
import sys

from mtc.head.supervisor import Supervisor, SupervisorConfigError


def main(argv: list[str]) -> int:
    warm: list[str] = []
    if argv[:1] == ["--warm"] and len(argv) > 1:
        warm, argv = [m for m in argv[1].split(",") if m], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[:1] == ["-m"] and len(argv) < 2:
        print("usage: python -m mtc.head.supervisor [--warm MODULE,...] -- (-m MODULE | SCRIPT) [ARG ...]",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        pod = Supervisor(argv, warm)
    except SupervisorConfigError as e:
        print(f"mtc: {e}", file=sys.stderr)
        return 2
    return pod.run()


sys.exit(main(sys.argv[1:]))
