"""Run a real sidecar daemon whose backup store holds one operation until the test releases it.

A finalize the head gave up on, still running on its host: the daemon's real store (the local
directory) sits behind ``StallingStore``, which reads a control file (JSON) at every operation::

    {"host": "s0-h0",       # only this host's store stalls
     "op": "list",          # the operation (list, put_bytes, put_file, get_bytes, delete, ...)
     "prefix": "blobs/",    # ... on a name (or listing prefix) that starts with this
     "skip": 1,             # the first matching operations pass (counted down)
     "stall": 1,            # the next ones wait (before they reach the store) until "release" is true
     "release": false,
     "stalled": 0}          # counted up by each operation that began to wait

Every other operation goes to the real store unchanged. ``LocalCluster(launch=...)`` puts this script
in front of the daemon's command line (``launch_with(control)``); it installs the wrapper where the
backup tier opens its store, then runs the daemon's own ``main``.
"""

from __future__ import annotations

import copy
import fcntl
import json
import sys
import time
from pathlib import Path

from mtc.shared.objstore.store import ObjectStore

MAX_STALL_S = 120.0


def launch_with(control: Path):
    """A ``LocalCluster`` ``launch`` function: every daemon's store obeys ``control``."""
    return lambda host_id: ([sys.executable, str(Path(__file__).resolve()), str(control), host_id], "127.0.0.1")


def set_control(control: Path, **doc) -> None:
    control.write_text(json.dumps(doc))


def read_control(control: Path) -> dict:
    with open(control) as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        return json.loads(f.read() or "{}")


def release(control: Path) -> None:
    _update(control, lambda doc: doc.update(release=True))


def _update(control: Path, change) -> dict:
    with open(control, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        doc = json.loads(f.read() or "{}")
        out = change(doc)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(doc))
        return out


class StallingStore(ObjectStore):
    """``store`` of host ``host``, whose operations obey the control file."""

    def __init__(self, store: ObjectStore, control: Path, host: str):
        self._store, self._control, self._host = store, control, host
        self.url = store.url

    def _gate(self, op: str, name: str) -> None:
        def take(doc: dict) -> bool:
            if doc.get("host") != self._host or doc.get("op") != op or not name.startswith(doc.get("prefix", "")):
                return False
            if doc.get("skip", 0) > 0:
                doc["skip"] -= 1
                return False
            if doc.get("stall", 0) > 0:
                doc["stall"] -= 1
                doc["stalled"] = doc.get("stalled", 0) + 1
                return True
            return False

        if not self._control.exists() or not _update(self._control, take):
            return
        t0 = time.monotonic()
        while not read_control(self._control).get("release") and time.monotonic() - t0 < MAX_STALL_S:
            time.sleep(0.05)

    def with_deadline(self, seconds: float) -> ObjectStore:
        other = copy.copy(self)  # keeps the guard (with_guard)
        other._store = self._store.with_deadline(seconds)
        return other

    def list(self, prefix: str = "") -> list[str]:
        self._check_guard()
        self._gate("list", prefix)
        return self._store.list(prefix)

    def put_file(self, name, path, *, if_absent=False):
        self._check_guard()
        self._gate("put_file", name)
        return self._store.put_file(name, path, if_absent=if_absent)

    def put_bytes(self, name, data, *, if_absent=False):
        self._check_guard()
        self._gate("put_bytes", name)
        return self._store.put_bytes(name, data, if_absent=if_absent)

    def get_range(self, name, offset, length):
        self._check_guard()
        self._gate("get_range", name)
        return self._store.get_range(name, offset, length)

    def get_to_file(self, name, path):
        self._check_guard()
        self._gate("get_to_file", name)
        return self._store.get_to_file(name, path)

    def get_bytes(self, name, **kw):
        self._check_guard()
        self._gate("get_bytes", name)
        return self._store.get_bytes(name, **kw)

    def exists(self, name):
        self._check_guard()
        self._gate("exists", name)
        return self._store.exists(name)

    def size(self, name):
        self._check_guard()
        self._gate("size", name)
        return self._store.size(name)

    def delete(self, name):
        self._check_guard()
        self._gate("delete", name)
        self._store.delete(name)

    def close(self):
        self._store.close()


def main() -> int:
    control, host = Path(sys.argv[1]), sys.argv[2]
    rest = sys.argv[3:]
    if rest[1:3] != ["-m", "mtc.sidecar"]:
        raise SystemExit(f"expected '<python> -m mtc.sidecar ...' after the control file and host, got {rest[:3]}")
    import mtc.sidecar.backup.tier as tier

    real = tier.open_store
    tier.open_store = lambda url, **kw: StallingStore(real(url, **kw), control, host)
    sys.argv = ["mtc.sidecar", *rest[3:]]
    from mtc.sidecar.daemon import main as daemon_main

    return daemon_main()


if __name__ == "__main__":
    sys.exit(main())
