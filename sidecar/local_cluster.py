"""A cluster of sidecar daemons on this machine: S slices x H hosts, each a real process.

``LocalCluster`` starts one ``python -m mtc.sidecar serve`` per host, with ``root/<host-id>/``
as the host's ramdisk, waits until every daemon answers, and writes the cluster spec that the
head reads (``.spec_path``; give it to ``MTCConfig(cluster_spec=...)``). Tests and demos use
it to kill, wipe and restart single hosts.

It never leaves processes behind: ``stop()`` runs on context exit and at interpreter exit,
and every daemon runs with a parent-death signal (``PR_SET_PDEATHSIG``, set by the daemon itself
from ``--parent-pid``), so even a ``kill -9`` of the process that owns the cluster takes its
daemons down with it. The daemon sets it rather than a ``preexec_fn``: a ``preexec_fn`` forces
a plain ``fork()`` of this (JAX-multithreaded) process and runs Python in the child before
``exec``, which can deadlock; without one, ``subprocess`` uses ``vfork``+``exec``.

Layout under ``root``::

    cluster.json          the cluster spec (rewritten when a restarted host changes address)
    <host-id>/            the host's ramdisk (local_checkpoint_directory); mtc uses <host-id>/mtc/
    logs/<host-id>.log    the daemon's log (appended across restarts)
    run/<host-id>.ready   {host, address, pid}, written by the daemon once it listens
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Mapping, Sequence

from mtc.shared import protocol, tls
from mtc.shared.errors import HostUnreachableError, ProtocolError
from mtc.sidecar.peer import ENV_TOKEN

log = logging.getLogger(__name__)

__all__ = ["LocalCluster"]

_POLL_S = 0.02
_STOP_TIMEOUT_S = 10.0


class _Spawner:
    """One long-lived daemon thread that forks every daemon process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked a child exits, so a caller's
    short-lived thread must not fork. A daemon thread (unlike an executor's worker) is not
    joined at interpreter shutdown, so ``stop()`` at exit still finds the daemons alive and
    stops them with SIGTERM, cleanly.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="mtc-cluster-spawn", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def call(self, fn):
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut.result()

    def close(self) -> None:
        self._q.put(None)
        self._t.join()


def _job_token() -> str:
    """This process's job token (``MTC_PEER_TOKEN``), made and set here when there is none."""
    token = os.environ.get(ENV_TOKEN, "").strip()
    if not token:
        token = os.environ[ENV_TOKEN] = secrets.token_hex(32)
    return token


class LocalCluster:
    """``num_slices`` x ``hosts_per_slice`` sidecar daemons under ``root`` (a context manager).

    Host ids are ``s<slice>-h<host>``, in the order the head assigns its devices
    (``devices_per_host`` each). ``env`` adds environment variables for the daemons (e.g.
    ``MTC_CRASH_AT``); each daemon follows the settings of the head that drives it (``configure``). ``launch(host_id)``
    gives a host's command prefix and listen address, e.g. ``(["ip", "netns", "exec", NS], IP)`` for
    a daemon in its own network namespace, which a test can cut off (the soak does).

    The daemons and the head share the job token: ``MTC_PEER_TOKEN`` of this process when it is
    set (as a head pod gets it from a Secret), else one generated once per process and put
    there, so that a head in this process, or one it starts, finds it (``.peer_token``). The
    daemons get it in their environment, never on the command line, where ``ps`` shows it.

    ``tls_dir`` (a folder ``mtc tls generate`` wrote; default ``MTC_TLS_DIR``, unset: clear text):
    every daemon serves its control and peer ports over mutual TLS with it (``--tls-dir``); a
    head must then use it too (config ``tls_dir``).
    """

    def __init__(self, root: str | os.PathLike, num_slices: int, hosts_per_slice: int, *,
                 devices_per_host: int = 2, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 60.0,
                 launch: Callable[[str], tuple[Sequence[str], str]] | None = None,
                 tls_dir: str | os.PathLike | None = None):
        for name, v in (("num_slices", num_slices), ("hosts_per_slice", hosts_per_slice),
                        ("devices_per_host", devices_per_host)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.root = Path(root).resolve()
        self.num_slices = num_slices
        self.hosts_per_slice = hosts_per_slice
        self.devices_per_host = devices_per_host
        self.startup_timeout = float(startup_timeout)
        self._env = dict(env or {})
        # host id -> (argv prefix, address to listen on): e.g. ``(["ip", "netns", "exec", NS], IP)`` runs a
        # host in its own network namespace, so a test can cut it off (default: here, on 127.0.0.1).
        self._launch = launch
        self._hosts = [f"s{s}-h{h}" for s in range(num_slices) for h in range(hosts_per_slice)]
        self._slice = {f"s{s}-h{h}": s for s in range(num_slices) for h in range(hosts_per_slice)}
        self._procs: dict[str, subprocess.Popen] = {}
        self._addresses: dict[str, str] = {}
        self._peer_addresses: dict[str, str] = {}
        self.peer_token = _job_token()
        files = tls.resolve(Path(tls_dir).resolve() if tls_dir else None)  # checked here, not in each daemon
        self.tls_dir = None if files is None else str(Path(files.ca).parent)
        self._tls = None if files is None else tls.client_context(files)  # what the readiness ping dials with
        self._lock = threading.RLock()
        self._spawner: _Spawner | None = None
        self._started = False

    # --- paths and facts -------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        """Host ids, in spec order (slice-major)."""
        return list(self._hosts)

    @property
    def spec_path(self) -> Path:
        return self.root / "cluster.json"

    def slice_of(self, host_id: str) -> int:
        return self._slice[self._check(host_id)]

    def ramdisk(self, host_id: str) -> Path:
        """The host's ramdisk directory (its local_checkpoint_directory)."""
        return self.root / self._check(host_id)

    def store_root(self, host_id: str) -> Path:
        """Where the host's RAM tier keeps blobs/, steps/ and pending/."""
        return self.ramdisk(host_id) / "mtc"

    def log_path(self, host_id: str) -> Path:
        return self.root / "logs" / f"{self._check(host_id)}.log"

    def _ready_path(self, host_id: str) -> Path:
        return self.root / "run" / f"{host_id}.ready"

    def address(self, host_id: str) -> str:
        return self._addresses[self._check(host_id)]

    def peer_address(self, host_id: str) -> str:
        """The address of the host's peer service (changes when the daemon restarts)."""
        return self._peer_addresses[self._check(host_id)]

    def pid(self, host_id: str) -> int | None:
        p = self._procs.get(self._check(host_id))
        return None if p is None else p.pid

    def is_running(self, host_id: str) -> bool:
        p = self._procs.get(self._check(host_id))
        return p is not None and p.poll() is None

    def wait(self, host_id: str, timeout: float = _STOP_TIMEOUT_S) -> int:
        """Wait until the host's daemon has exited (e.g. at a crash point); its exit code
        (negative: killed by that signal). subprocess.TimeoutExpired if it is still running."""
        return self._procs[self._check(host_id)].wait(timeout=timeout)

    def pids(self) -> dict[str, int]:
        """host id -> pid of every daemon started (running or not)."""
        return {h: p.pid for h, p in self._procs.items()}

    def _check(self, host_id: str) -> str:
        if host_id not in self._slice:
            raise KeyError(f"unknown host {host_id!r}; hosts: {self._hosts}")
        return host_id

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> "LocalCluster":
        """Start every daemon, wait until each answers, write the spec."""
        with self._lock:
            if self._started:
                return self
            self._started = True
            for d in (self.root, self.root / "logs", self.root / "run"):
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o700)  # least privilege: the weights, logs and addresses are the job's own
            self._spawner = _Spawner()
            atexit.register(self.stop)
            try:
                t0 = time.perf_counter()
                for h in self._hosts:
                    self._spawn(h, None)
                for h in self._hosts:
                    self._wait_ready(h)
                self._write_spec()
                log.info("local cluster of %d hosts up in %.2fs under %s", len(self._hosts),
                         time.perf_counter() - t0, self.root)
            except BaseException:
                self.stop()
                raise
        return self

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, host_id: str, extra_env: Mapping[str, str] | None) -> None:
        ready = self._ready_path(host_id)
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        env = dict(os.environ)
        env[ENV_TOKEN] = self.peer_token
        env.update(self._env)
        env.update(extra_env or {})
        prefix, ip = self._launch(host_id) if self._launch is not None else ((), "127.0.0.1")
        cmd = [*prefix, sys.executable, "-m", "mtc.sidecar", "serve", "--root", str(self.ramdisk(host_id)),
               "--host-id", host_id, "--listen", f"{ip}:0", "--peer-listen", f"{ip}:0", "--ready-file", str(ready),
               "--log-file", str(self.log_path(host_id)),
               "--parent-pid", str(os.getpid()), *(("--tls-dir", self.tls_dir) if self.tls_dir else ())]

        def popen() -> subprocess.Popen:
            # Output before logging is set up (an import error) lands in the log too.
            fd = os.open(self.log_path(host_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "ab") as out:
                return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        close_fds=True)

        self._procs[host_id] = self._spawner.call(popen)

    def _wait_ready(self, host_id: str) -> None:
        proc = self._procs[host_id]
        deadline = time.monotonic() + self.startup_timeout
        ready = self._ready_path(host_id)
        while True:
            rc = proc.poll()
            if rc is not None:
                raise HostUnreachableError(f"host {host_id}: daemon exited with code {rc} while starting; "
                                           f"log {self.log_path(host_id)}:\n{self._log_tail(host_id)}")
            doc = _read_json(ready)
            if doc is not None and doc.get("pid") == proc.pid:
                address = doc["address"]
                if _ping(address, host_id, self._tls):
                    self._addresses[host_id] = address
                    if doc.get("peer"):
                        self._peer_addresses[host_id] = doc["peer"]
                    return
            if time.monotonic() > deadline:
                raise HostUnreachableError(f"host {host_id}: daemon did not answer within {self.startup_timeout:.0f}s; "
                                           f"log {self.log_path(host_id)}:\n{self._log_tail(host_id)}")
            time.sleep(_POLL_S)

    def _log_tail(self, host_id: str, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path(host_id).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _write_spec(self) -> None:
        spec = protocol.ClusterSpec(tuple(
            protocol.HostSpec(h, self._slice[h], self._addresses.get(h, "127.0.0.1:0"), self.devices_per_host)
            for h in self._hosts))
        spec.write(self.spec_path)

    # --- faults ----------------------------------------------------------------------------

    def kill(self, host_id: str, sig: int = signal.SIGKILL, *, wait: bool = True) -> int | None:
        """Send ``sig`` to the host's daemon; for SIGKILL/SIGTERM/SIGINT wait until it is gone.

        Returns the exit code (None when not waited for). Killing a stopped daemon is a no-op.
        """
        with self._lock:
            proc = self._procs.get(self._check(host_id))
            if proc is None or proc.poll() is not None:
                return None if proc is None else proc.returncode
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            if wait and sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                return proc.wait(timeout=_STOP_TIMEOUT_S)
            return None

    def wipe(self, host_id: str) -> None:
        """Lose the host's ramdisk, as a replaced node would: kill its daemon, delete the contents.

        The daemon stays down; ``restart(host_id)`` brings up a fresh one on the empty ramdisk.
        """
        with self._lock:
            self.kill(host_id, signal.SIGKILL)
            d = self.ramdisk(host_id)
            if d.exists():
                for p in d.iterdir():
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    else:
                        p.unlink()

    def restart(self, host_id: str, *, env: Mapping[str, str] | None = None) -> str:
        """(Re)start the host's daemon with the same id and ramdisk; returns its new address.

        A running daemon is stopped first (SIGTERM). ``env`` adds variables for this start only
        (e.g. ``{"MTC_CRASH_AT": "before_commit"}``). The spec is rewritten with the new address.
        """
        with self._lock:
            if not self._started:
                raise RuntimeError("LocalCluster is not started; use it as a context manager")
            self._terminate([self._check(host_id)])
            self._spawn(host_id, env)
            self._wait_ready(host_id)
            self._write_spec()
            return self._addresses[host_id]

    def stop(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL after 10 s). Safe to call twice."""
        with self._lock:
            self._terminate(list(self._procs))
            if self._spawner is not None:
                self._spawner.close()
                self._spawner = None
            with contextlib.suppress(Exception):
                atexit.unregister(self.stop)
            self._started = False

    def _terminate(self, host_ids: list[str]) -> None:
        procs = [self._procs[h] for h in host_ids if h in self._procs]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("daemon pid %d did not stop on SIGTERM within %.0fs; killing it", p.pid, _STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _ping(address: str, host_id: str, context: ssl.SSLContext | None = None) -> bool:
    """True when the daemon at ``address`` answers a ping as ``host_id`` (over TLS with ``context``)."""
    try:
        with socket.create_connection(protocol.parse_address(address), timeout=5) as raw, \
                (raw if context is None else context.wrap_socket(raw)) as s:
            protocol.send_request(s, protocol.Request("ping", 0))
            reply = protocol.recv_reply(s)
    except (OSError, ProtocolError):
        return False
    return reply.error is None and isinstance(reply.result, dict) and reply.result.get("host") == host_id


def serve_cluster(argv: Sequence[str] | None = None) -> int:
    """``python -m mtc.sidecar cluster --root R --slices S --hosts H [--devices-per-host D]``.

    Starts a LocalCluster and takes commands from stdin, one JSON object a line, answering one
    JSON line each on stdout: ``{"op": "spec"}`` (the spec path and the host ids), ``{"op": "kill",
    "host": H}`` (SIGKILL), ``{"op": "wipe", "host": H}`` (kill and empty its ramdisk), ``{"op":
    "restart", "host": H, "env": {...}}``, ``{"op": "alive"}`` (host -> running). End of input
    stops the cluster. This is how a head-side program (the demo) drives local sidecars without
    importing them.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m mtc.sidecar cluster")
    p.add_argument("--root", required=True)
    p.add_argument("--slices", type=int, required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--tls-dir", help="serve over mutual TLS with this folder's ca.crt, tls.crt, tls.key")
    a = p.parse_args(argv)
    with LocalCluster(a.root, a.slices, a.hosts, devices_per_host=a.devices_per_host, tls_dir=a.tls_dir) as cluster:
        def answer(doc: dict) -> None:
            sys.stdout.write(json.dumps(doc) + "\n")
            sys.stdout.flush()

        answer({"spec": str(cluster.spec_path), "hosts": cluster.hosts})
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                op, host = cmd.get("op"), cmd.get("host")
                if op == "spec":
                    answer({"spec": str(cluster.spec_path), "hosts": cluster.hosts})
                elif op == "kill":
                    cluster.kill(host)
                    answer({"ok": True})
                elif op == "wipe":
                    cluster.wipe(host)
                    answer({"ok": True})
                elif op == "restart":
                    answer({"ok": True, "address": cluster.restart(host, env=cmd.get("env") or None)})
                elif op == "alive":
                    answer({"alive": {h: cluster.is_running(h) for h in cluster.hosts}})
                else:
                    answer({"error": f"unknown op {op!r}; ops: spec, kill, wipe, restart, alive"})
            except Exception as e:  # one bad command must not take the cluster down
                answer({"error": f"{type(e).__name__}: {e}"})
    return 0
