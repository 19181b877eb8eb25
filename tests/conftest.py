"""Test setup shared by every test: 8 CPU devices, a tmpfs ramdisk folder per test."""

from __future__ import annotations

import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_SHM = Path("/dev/shm")


# The suite runs real ramdisks, sidecars and MaxText on tmpfs: with less memory than this free, the
# kernel's OOM killer ends test workers mid-test and the run hangs or fails far from the cause.
MIN_FREE_GIB = 6


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller checked
        return
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return
    free_kib = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    if free_kib is None or free_kib >= MIN_FREE_GIB << 20:
        return
    held = []
    if _SHM.is_dir():
        for entry in _SHM.iterdir():
            try:
                size = sum(f.stat().st_size for f in ([entry] if entry.is_file() else entry.rglob("*")) if f.is_file())
            except OSError:
                continue
            held.append((size, entry))
    held.sort(reverse=True)
    biggest = "".join(f"\n  {size / 2**30:6.1f} GiB  {entry}" for size, entry in held[:8] if size >= 2**28)
    pytest.exit(f"only {free_kib / 2**20:.1f} GiB of memory is free; the tests need {MIN_FREE_GIB} GiB (tmpfs "
                f"ramdisks, sidecars, MaxText). Files on tmpfs hold memory until removed"
                + (f"; the largest in {_SHM}:{biggest}\nremove what is not in use" if biggest else "")
                + ", or stop what else is running.", returncode=3)


# --- layers: a test's folder is its layer marker ---------------------------------------------------
LAYERS = ("unit", "integration", "chaos", "maxtext", "images")
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's layer (``-m unit`` selects exactly tests/unit), and refuse a test
    that carries another folder's ``unit`` marker or sits in tests/unit with a slower layer's marker:
    the folder and the marker must say the same."""
    wrong = []
    for item in items:
        try:
            layer = Path(str(item.path)).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        if layer not in LAYERS:
            continue
        marks = {m.name for m in item.iter_markers() if m.name in LAYERS}
        if layer == "unit" and marks - {"unit"} or layer != "unit" and "unit" in marks:
            wrong.append(f"{item.nodeid}: in tests/{layer}, marked {', '.join(sorted(marks))}")
        item.add_marker(getattr(pytest.mark, layer))
    if wrong:
        raise pytest.UsageError("tests whose layer marker and folder disagree (move the test, or drop the marker):\n  "
                                + "\n  ".join(wrong))


# --- what runs now, during the long tail -----------------------------------------------------------
# The fast layers fill most of the dots in the first minutes; then a few slow tests (MaxText, the soak)
# run for minutes each with no output. Every HEARTBEAT_S, the tests running longer than that are named
# (by the xdist controller, which runs no test: README's `-n 2`; without xdist the test's output capture
# would take the lines).
HEARTBEAT_S = float(os.environ.get("MTC_TEST_HEARTBEAT_S", "60"))


class _Heartbeat:
    def __init__(self, reporter) -> None:
        import threading

        self._reporter = reporter
        self._running: dict[str, float] = {}  # nodeid -> when it started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="test-heartbeat", daemon=True).start()

    def started(self, nodeid: str) -> None:
        import time

        with self._lock:
            self._running[nodeid] = time.monotonic()

    def finished(self, nodeid: str) -> None:
        with self._lock:
            self._running.pop(nodeid, None)

    def _loop(self) -> None:
        import time

        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            with self._lock:
                slow = sorted((now - t, n) for n, t in self._running.items() if now - t >= HEARTBEAT_S)
                if slow:
                    self._reporter.write_line("")
                    for took, nodeid in slow:
                        self._reporter.write_line(f"  still running after {took:.0f} s: {nodeid}")

    def close(self) -> None:
        self._stop.set()


_BEAT: list[_Heartbeat] = []  # the controller's (or a run without xdist's), once the session started


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        _BEAT[:] = [_Heartbeat(reporter)]


def pytest_runtest_logstart(nodeid, location):
    for beat in _BEAT:
        beat.started(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    for beat in _BEAT:
        beat.finished(nodeid)


def pytest_sessionfinish(session):
    for beat in _BEAT:
        beat.close()
    _BEAT.clear()


@pytest.fixture
def ramdisk():
    """A fresh directory on tmpfs (/dev/shm when present), removed afterwards."""
    base = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="mtc-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def inprocess_daemon(ramdisk, monkeypatch):
    """A sidecar daemon in this process (real sockets, driven by the real head) whose service the
    test can reach, and a one-host cluster spec for it: ``make(max_to_keep) -> (service, spec)``.
    The daemons made are closed afterwards."""
    import jax

    from mtc.shared import protocol
    from mtc.sidecar.daemon import SidecarDaemon
    from mtc.sidecar.service import SidecarService

    token = "inprocess-daemon-test-token"
    monkeypatch.setenv("MTC_PEER_TOKEN", token)
    daemons = []

    def make(max_to_keep: int = 2):
        svc = SidecarService(ramdisk / "host" / "mtc", host_id="s0-h0", max_to_keep=max_to_keep)
        daemon = SidecarDaemon(svc, token)
        daemon.start()
        daemons.append(daemon)
        spec = ramdisk / "cluster.json"
        protocol.ClusterSpec((protocol.HostSpec("s0-h0", 0, daemon.address, len(jax.devices())),)).write(spec)
        return svc, spec

    yield make
    for daemon in daemons:
        daemon.close()


def _mount_tmpfs(mnt, options: str, what: str):
    """Mount a real tmpfs at ``mnt`` for a fixture to yield, unmount after; skips the test without root."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {what} (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def tmpfs16(tmp_path):
    """A real 16 MiB tmpfs mount (a ramdisk that fills up), unmounted afterwards; needs root."""
    yield from _mount_tmpfs(tmp_path / "ramdisk", "size=16m", "a 16 MiB tmpfs")


@pytest.fixture
def huge_tmpfs(tmp_path):
    """A real tmpfs mounted ``huge=within_size`` (2 MiB pages), the recommended ramdisk; needs root."""
    yield from _mount_tmpfs(tmp_path / "huge-ramdisk", "size=2g,huge=within_size", "a huge-page tmpfs")


@pytest.fixture
def small_huge_tmpfs(tmp_path):
    """A real 8 MiB tmpfs with 2 MiB pages: a huge-page ramdisk that fills up; needs root."""
    yield from _mount_tmpfs(tmp_path / "small-huge-ramdisk", "size=8m,huge=within_size", "an 8 MiB huge-page tmpfs")
