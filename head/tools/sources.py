"""Where the tools (``mtc status``, ``mtc export``) read a job's steps from.

A running local cluster (its cluster spec), the ramdisk folders of a stopped job (a sidecar
daemon is started on each for the time of one command), or the backup tier alone (one daemon
on an empty scratch folder, which the restore fills from the backup).

A folder's host id is read from what it holds: the id its sidecar noted (``host.json``); in a
folder without that note (an older mtc), each host's commit record of a step names its own part; a host that keeps whole step manifests is the host whose part's blobs it holds, among
those no other folder is. ``ID=DIR`` names it where that cannot tell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Sequence

from mtc.shared import format as fmt
from mtc.shared import protocol
from mtc.shared.config import ENV_TOKEN
from mtc.shared.errors import ConfigError, MTCError
from mtc.shared.job_key import JobKey
from mtc.shared.safe_files import MAX_MANIFEST_BYTES, MAX_NOTE_BYTES, read_first_line, read_regular


def _first_lines(d: Path) -> Iterator[tuple[Path, bytes]]:
    """(file, its first line) of each committed step of ``d``, newest first: a commit record whole (it is one
    line), a step manifest's header (its parts, hundreds of MiB at thousands of hosts, are not read)."""
    for f in sorted((d / "mtc" / "steps").glob("*.json"), reverse=True):
        try:
            yield f, read_first_line(f, MAX_MANIFEST_BYTES, "step manifest")
        except OSError:  # gone, unreadable, or not a regular file (UntrustedFileError)
            continue


def _part_blobs(files: Sequence[Path]) -> dict[str, set[str]]:
    """host -> the blobs of its part, from the whole step manifests in ``files`` (read only to tell a
    folder's host by the blobs it holds)."""
    parts: dict[str, set[str]] = {}
    for f in files:
        try:
            m = fmt.StepManifest.from_json(read_regular(f, MAX_MANIFEST_BYTES, "step manifest"))
        except (OSError, MTCError):
            continue
        for h, blobs in (m.part_blobs or {}).items():
            parts.setdefault(h, set()).update(blobs)
    return parts


def folder_hosts(args: Sequence[str]) -> list[tuple[str, Path, int]]:
    """(host id, folder, slice) of each ``DIR`` or ``ID=DIR`` (the id read from the folder when not
    given; the slice from the newest step manifest that names the slices, else 0)."""
    named: list[tuple[str | None, Path]] = []
    for a in args:
        hid, sep, path = a.partition("=")
        d = Path(path if sep else a)
        if not (d / "mtc").is_dir():
            raise ConfigError(f"{d} holds no mtc ramdisk ({d / 'mtc'} does not exist); pass the "
                              "local_checkpoint_directory the job used (a host whose ramdisk was lost holds "
                              "nothing to read: leave its folder out, and the others say what it held)")
        named.append((hid if sep else None, d))
    slices: dict[str, int] = {}
    whole: list[Path] = []  # step manifests: their parts tell a folder's host by the blobs it holds
    found: list[str | None] = []
    for hid, d in named:
        own = hid or _noted(d)
        for f, line in _first_lines(d):
            try:
                rec = fmt.CommitRecord.parse(line)
                if rec is not None:
                    own = own or rec.host_manifest().host
                    continue
                topology = fmt.StepHeader.from_line(line).topology
            except MTCError:  # an older format (its document over several lines) is read whole
                try:
                    data = read_regular(f, MAX_MANIFEST_BYTES, "step manifest")
                    topology = fmt.StepManifest.from_json(data).topology
                except (OSError, MTCError):
                    continue
            whole.append(f)
            for h, sl in (topology.get("slices") or {}).items():
                if isinstance(sl, int):
                    slices.setdefault(h, sl)
        found.append(own)
    parts = _part_blobs(whole) if None in found else {}
    for i, (hid, d) in enumerate(named):
        if found[i] is not None:
            continue
        have = {p.name for p in (d / "mtc" / "blobs").iterdir()} if (d / "mtc" / "blobs").is_dir() else set()
        left = [h for h in sorted(parts) if h not in found and parts[h] <= have]
        # Data-parallel twins hold the same blobs: either id reads the same; the folder's name breaks the tie.
        left.sort(key=lambda h: h not in (d.name, d.parent.name))
        if not left:
            raise ConfigError(f"cannot tell which host the ramdisk folder {d} belongs to (no step on it names its "
                              "host); name it as HOST_ID=DIR, with the id the job gave that host")
        found[i] = left[0]
    dupes = sorted({h for h in found if found.count(h) > 1})
    if dupes:
        raise ConfigError(f"two folders hold host {dupes[0]}'s steps; pass each host's folder once "
                          "(or name them as HOST_ID=DIR)")
    return [(h, d, slices.get(h, 0)) for h, (_, d) in zip(found, named)]  # type: ignore[misc]


def _noted(d: Path) -> str | None:
    """The host id the sidecar that served ``d`` wrote there (``host.json``), if any."""
    try:
        host = json.loads(read_regular(d / "mtc" / "host.json", MAX_NOTE_BYTES, "host note")).get("host")
    except (OSError, ValueError, AttributeError):
        return None
    return host if isinstance(host, str) and host else None


_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the tool's own cleanup runs: its temporary daemons are stopped


class TempDaemons:
    """A sidecar daemon on each ramdisk folder of a stopped job, for the time of one command.

    They die with the command: each is started with ``--parent-pid`` (the kernel kills it when
    this process dies, even by SIGKILL), and while they run a SIGTERM or SIGHUP to this process
    (from the main thread, where the default was to die at once) exits it through its cleanup,
    which stops them."""

    def __init__(self, hosts: Sequence[tuple[str, Path, int]]):
        self.tmp = Path(tempfile.mkdtemp(prefix="mtc-tool-"))
        # These daemons' own job token, for this one command; they keep the job's key (from this
        # environment's MTC_JOB_KEY or MTC_PEER_TOKEN) to check the backups' seals with.
        self.token = secrets.token_hex(32)
        self.procs: list[subprocess.Popen] = []
        self._handlers: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _EXIT_SIGNALS:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    self._handlers[sig] = signal.signal(sig, _exit_on_signal)
        ready_files = []
        for i, (hid, d, _) in enumerate(hosts):
            ready = self.tmp / f"{i}.ready"
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "mtc.sidecar", "serve", "--root", str(d), "--host-id", hid,
                 "--ready-file", str(ready), "--log-file", str(self.tmp / f"{i}.log"),
                 "--parent-pid", str(os.getpid())],
                env={**os.environ, **JobKey.for_child(), ENV_TOKEN: self.token}))
            ready_files.append(ready)
        rows = []
        deadline = time.monotonic() + 60
        try:
            for (hid, d, sl), ready in zip(hosts, ready_files):
                while not ready.exists():
                    if time.monotonic() > deadline:
                        raise MTCError(f"the sidecar daemon on {d} did not start (its log is in {self.tmp})")
                    time.sleep(0.05)
                rows.append(protocol.HostSpec(hid, sl, json.loads(ready.read_text())["address"], 1))
            self.spec_path = self.tmp / "cluster.json"
            protocol.ClusterSpec(tuple(rows)).write(self.spec_path)
        except BaseException:  # a signal, or a daemon that did not start: none is left running
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
        for sig, previous in self._handlers.items():
            signal.signal(sig, previous)
        self._handlers = {}


@dataclasses.dataclass
class Hosts:
    """The hosts a tool talks to: their cluster spec, the job token to use ('' for this environment's
    MTC_PEER_TOKEN), device ids that only map shards to hosts, and the temporary daemons (if any)."""

    spec_path: Path
    token: str
    spec: protocol.ClusterSpec
    devices: list
    temp: TempDaemons | None = None

    def close(self) -> None:
        if self.temp is not None:
            self.temp.close()


def open_hosts(cluster_spec: str | None = None, rows: Sequence[tuple[str, Path, int]] = ()) -> Hosts:
    """A running local cluster (its spec), or a temporary daemon on each of ``rows`` (``folder_hosts``)."""
    temp = TempDaemons(rows) if not cluster_spec else None
    spec_path = Path(cluster_spec) if cluster_spec else temp.spec_path
    try:
        spec = protocol.ClusterSpec.read(spec_path)  # validated: a clear error for a wrong file
    except BaseException:
        if temp is not None:
            temp.close()
        raise
    devices = [SimpleNamespace(id=i) for i in range(sum(h.devices for h in spec.hosts))]
    return Hosts(spec_path, temp.token if temp is not None else "", spec, devices, temp)


# What a tool reports as its one line and exit status 2 (bad input, hosts it cannot reach or read).
TOOL_ERRORS = (ConfigError, MTCError, OSError, ValueError)


def refused(command: str, e: BaseException) -> int:
    """Say ``e`` as the one line of ``mtc COMMAND`` and give its exit status (2)."""
    print(f"mtc {command}: error: {e}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def job_hosts(cluster_spec: str | None, folders: Sequence[str] | None) -> Iterator[tuple[Hosts, list]]:
    """The hosts of a job for one command: a running local cluster (its spec), or a temporary daemon on
    each ramdisk folder of a stopped job (``folder_hosts``), stopped when the block ends; (hosts, the
    folders' rows). Exactly one of the two must be given (ConfigError otherwise)."""
    if bool(cluster_spec) == bool(folders):
        raise ConfigError("give the job's --cluster-spec (a running local cluster) or its "
                          "--local-checkpoint-directory (ramdisk folders of a stopped job; several allowed)")
    rows = folder_hosts(folders or [])
    hosts = open_hosts(cluster_spec, rows)
    try:
        yield hosts, rows
    finally:
        hosts.close()
