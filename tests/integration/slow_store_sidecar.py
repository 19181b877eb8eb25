"""Run a real sidecar daemon whose backup store answers its listing of ``backups/`` late, or fails it.

A store under load: the daemon's real store (the local directory) sits behind ``SlowListing``,
which reads a control file (JSON) at every listing of ``backups/``::

    {"delay_s": 3.0,        # each listing answers this late
     "fail": 2,             # the next 2 listings fail (counted down, across the daemons that share the file)
     "error": "transient"}  # ... with TransientStoreError (a store that timed out), or "fatal"

Everything else goes to the real store unchanged. ``LocalCluster(launch=...)`` puts this script in
front of the daemon's command line (``launch_with(control)``); it installs the wrapper wherever the
daemon opens a store, then runs the daemon's own ``main``.
"""

from __future__ import annotations

import copy
import fcntl
import json
import sys
import time
from pathlib import Path

from mtc.shared.objstore.store import FatalStoreError, ObjectStore, TransientStoreError


def launch_with(control: Path):
    """A ``LocalCluster`` ``launch`` function: every daemon's store listing obeys ``control``."""
    return lambda host_id: ([sys.executable, str(Path(__file__).resolve()), str(control)], "127.0.0.1")


def set_control(control: Path, **doc) -> None:
    control.write_text(json.dumps(doc))


def _take(control: Path) -> tuple[float, str | None]:
    """(delay, error kind or None) for this listing; a failure is counted down under a file lock."""
    with open(control, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        doc = json.loads(f.read() or "{}")
        error = None
        if doc.get("fail", 0) > 0:
            doc["fail"] -= 1
            error = doc.get("error", "transient")
            f.seek(0)
            f.truncate()
            f.write(json.dumps(doc))
        return float(doc.get("delay_s", 0.0)), error


class SlowListing(ObjectStore):
    """``store``, whose listings of ``backups/`` obey the control file."""

    def __init__(self, store: ObjectStore, control: Path):
        self._store, self._control = store, control
        self.url = store.url

    def with_deadline(self, seconds: float) -> ObjectStore:
        other = copy.copy(self)  # keeps the guard (with_guard)
        other._store = self._store.with_deadline(seconds)
        return other

    def list(self, prefix: str = "") -> list[str]:
        self._check_guard()
        if prefix.startswith("backups"):
            delay, error = _take(self._control)
            time.sleep(delay)
            if error == "fatal":
                raise FatalStoreError(f"list {self.url}{prefix}: 403 refused (injected)")
            if error:
                raise TransientStoreError(f"list {self.url}{prefix}: still failing after 3 tries in {delay:.1f} s: "
                                          "ReadTimeout (injected: a store under load)")
        return self._store.list(prefix)

    def put_file(self, name, path, *, if_absent=False):
        self._check_guard()
        return self._store.put_file(name, path, if_absent=if_absent)

    def put_bytes(self, name, data, *, if_absent=False):
        self._check_guard()
        return self._store.put_bytes(name, data, if_absent=if_absent)

    def get_to_file(self, name, path):
        self._check_guard()
        return self._store.get_to_file(name, path)

    def get_bytes(self, name, **kw):
        self._check_guard()
        return self._store.get_bytes(name, **kw)

    def get_range(self, name, offset, length):
        self._check_guard()
        return self._store.get_range(name, offset, length)

    def exists(self, name):
        self._check_guard()
        return self._store.exists(name)

    def size(self, name):
        self._check_guard()
        return self._store.size(name)

    def delete(self, name):
        self._check_guard()
        self._store.delete(name)

    def close(self):
        self._store.close()


def main() -> int:
    control = Path(sys.argv[1])
    rest = sys.argv[2:]
    if rest[1:3] != ["-m", "mtc.sidecar"]:
        raise SystemExit(f"expected '<python> -m mtc.sidecar ...' after the control file, got {rest[:3]}")
    import mtc.shared.objstore as objstore
    import mtc.sidecar.backup.tier as tier

    # Both places a daemon opens a store: the backup tier's own (the configured root) and the
    # reader's (a listing asked before the head configured the host, ``mtc status``).
    real = objstore.open_store
    tier.open_store = objstore.open_store = lambda url, **kw: SlowListing(real(url, **kw), control)
    sys.argv = ["mtc.sidecar", *rest[3:]]
    from mtc.sidecar.daemon import main as daemon_main

    return daemon_main()


if __name__ == "__main__":
    sys.exit(main())
