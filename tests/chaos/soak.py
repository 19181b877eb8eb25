"""Fault-matrix soak: randomized faults over many save/restore cycles, every restore checked bit for bit.

    python -m tests.chaos.soak --minutes 30 --seed N      (from the repository root)
    python -m tests.chaos.soak --trials 40 --seed N       (a fixed number of trials: an exact replay)

A run is a sequence of *segments*, each a fresh local cluster of real sidecar daemons (2 slices x 2
hosts, or 1 slice x 4 hosts; every host's ramdisk a size-limited tmpfs mount) with backups to
fake-gcs-server (filesystem backend, so a stopped server comes back with its objects) or to a local
directory, and one head process (``soak_head.py``) that saves a training-like state every step. Each
*trial* draws a fault class (the least-counted one the segment can inject; ties broken by the seed),
injects it between or during saves, heals what a real job's operator or scheduler would (restarts a
killed host, brings the bucket back), and then checks the invariants:

- the step a restore chooses is at least the newest committed step whose every blob still has a good
  copy (verified by hashing the files) on a reachable host or in an intact backup, and the soak's
  manifest was not corrupted by it ("lost committed steps" otherwise);
- every restore equals, bit for bit, the state saved at that step (a sha256 of every leaf, kept for
  every step the soak asked to save) with the requested shardings ("wrong restores" otherwise);
- no step whose save failed is listed; no host holds a committed step without its own blobs; no
  backup manifest is listed without all its blobs;
- corrupt bytes never reach a restore (a corrupt only copy fails the restore with an error that names
  the array; the soak then restores the step the oracle says is intact);
- the next save after the fault succeeds; nothing leaks (child processes, daemons' open files and
  sockets, ``pending/`` folders, temp blobs).

The seed is printed; ``--seed N`` replays the same schedule (each trial draws its parameters from its
own generator, seeded by the run seed and the trial number, so outcomes do not shift later trials).
The first violated invariant stops the run and prints the schedule up to it. An injection that fails
(the soak's own fault: a filler file that cannot be created on a full ramdisk, a process already gone,
an ``ip`` command refused) stops nothing: it is that trial's outcome, counted in the table and named in
the notes; the soak puts back what the fault may have left half done and checks the invariants as
after any trial. At the end, a table per fault class: injected, injections that failed, survived,
restores checked, wrong restores, lost committed steps, and the median and worst time from the fault
to the first verified restore after it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import random
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

try:
    import psutil
    import xxhash
except ImportError as e:  # run from the demo's environment: say what to install, not a traceback
    sys.exit(f"the soak needs the test dependencies ({e.name} is missing): "
             ".venv/bin/pip install -e '.[test,bench]' (README's second command sets them up)")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "integration"))

import soak_state  # noqa: E402
from gcs_emulators import FAKE_GCS, EmulatorServer  # noqa: E402

from mtc.shared import protocol  # noqa: E402
from mtc.sidecar.faults import CRASH_POINTS  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

HEAD_SCRIPT = HERE / "soak_head.py"
RELAY_SCRIPT = HERE / "delay_relay.py"
RELAY_PORT = 9111  # in each host's namespace, below the ephemeral ports the daemons listen on
RELAY_MARK = 0x5A  # the relay's own connections: its rules let them pass
DELAY_TABLE, LOSS_TABLE = "mtc_soak_delay", "mtc_soak_loss"
DEVICES_PER_HOST = 2
RAMDISK_MB = 24
RUN = "soak"
BUCKET = "mtc-soak"
# Bounds for the leak checks: far above what a healthy daemon uses, far below what a leak reaches.
MAX_DAEMON_FDS = 400
MAX_DAEMON_SOCKETS = 120
MAX_TEMP_BLOBS = 64
CALL_TIMEOUT_S = 240.0

CRASH_CLASSES = [f"crash:{p}" for p in sorted(CRASH_POINTS)]
FAULT_CLASSES = [
    "kill_sidecar", *CRASH_CLASSES, "kill_head", "wipe_host", "wipe_slice", "wipe_all",
    "flip_ram_blob", "flip_peer_copy", "flip_backup_blob", "flip_manifest",
    "gcs_outage", "gcs_outage_head_restart", "ramdisk_full", "slice_lost", "garbage_peer", "net_cut",
    "net_slow", "net_partition", "net_loss", "net_latency",
]
# Drawn where the hosts have network namespaces; the last two also need nftables (``nft``).
NET_CLASSES = {"net_cut", "net_slow", "net_partition", "net_loss", "net_latency"}
NFT_CLASSES = {"net_loss", "net_latency"}
GCS_ONLY = {"gcs_outage", "gcs_outage_head_restart"}

# Segments cycle through these: both topologies, both backup backends.
SEGMENTS = [((2, 2), "gcs"), ((1, 4), "local"), ((2, 2), "local"), ((1, 4), "gcs")]


class Violation(AssertionError):
    """An invariant did not hold."""


class CannotDraw(Exception):
    """No class the run may draw (``--only``) can be injected on any of its segments here."""


class HeadDied(RuntimeError):
    pass


# --- hosts in their own network namespaces ---------------------------------------------------------


class HostNetwork:
    """Every host in its own network namespace, on one bridge here: ``cut(h)`` takes its link down.

    Addresses ``10.231.N.1`` (the bridge: the head, the bucket) and ``10.231.N.(i + 2)`` (host i); the
    daemons listen on their own address, so the head and the other hosts reach them over the bridge.
    """

    def __init__(self, tag: int | None, hosts: list[str]):
        """``tag`` None: one no other soak of this machine holds (``claim_tag``), kept until ``close()``."""
        self._claim: int | None = None
        if tag is None:
            tag, self._claim = claim_tag()
        self.tag = tag
        self.net = f"10.231.{tag % 250}"
        self.bridge = f"mtsb{tag}"
        self.hosts = {h: (f"mtc-soak-{tag}-{i}", f"mtsv{tag}-{i}", f"{self.net}.{i + 2}") for i, h in enumerate(hosts)}
        self.up = False
        self.relays: dict[str, subprocess.Popen] = {}
        self.nft = shutil.which("nft") is not None

    @property
    def gateway(self) -> str:
        return f"{self.net}.1"

    def start(self) -> "HostNetwork":
        self.up = True  # from the first command on, close() undoes what was made
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, veth, addr in self.hosts.values():
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def launch(self, host: str) -> tuple[list[str], str]:
        ns, _, addr = self.hosts[host]
        return ["ip", "netns", "exec", ns], addr

    def cut(self, host: str) -> None:
        _ip("link", "set", self.hosts[host][1], "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self.hosts[host][1], "up")

    def slow(self, host: str, mbit: int) -> None:
        """Cap the host's link at ``mbit`` both ways (a token bucket on each end of its veth pair)."""
        ns, veth, _ = self.hosts[host]
        for where in (["dev", veth], ["-n", ns, "dev", "eth0"]):
            netns, dev = (where[:2], where[2:]) if where[0] == "-n" else ([], where)
            _tc(*netns, "qdisc", "replace", *dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb",
                "latency", "400ms")

    def unslow(self, host: str) -> None:
        ns, veth, _ = self.hosts[host]
        _tc("qdisc", "del", "dev", veth, "root", check=False)
        _tc("-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)

    # Packet loss and latency: nftables in the host's namespace (a numgen drop; a redirect of every TCP
    # connection through a delaying relay, ``delay_relay.py``), where ``nft`` is installed.

    def start_relays(self, log_dir: Path | None = None) -> None:
        """A delaying relay in every host's namespace (no delay yet), its rules loaded: every TCP connection
        into or out of a host made from now on passes through it, so ``delay`` reaches open connections too.
        A relay's errors go to ``log_dir/relay-HOST.log``."""
        import delay_relay

        setpriv = shutil.which("setpriv")  # a relay dies with the soak
        for h, (ns, _, _) in self.hosts.items():
            argv = ["ip", "netns", "exec", ns, sys.executable, str(RELAY_SCRIPT), str(RELAY_PORT), str(RELAY_MARK)]
            with open(log_dir / f"relay-{h}.log", "ab") if log_dir else open(os.devnull, "wb") as log:
                p = subprocess.Popen([setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            self.relays[h] = p
            ready, _, _ = select.select([p.stdout], [], [], 30)
            if not ready or p.stdout.readline() != b"ready\n":
                raise OSError(f"the delaying relay in {ns} did not start (exit {p.poll()})")
            _nft(ns, delay_relay.nft_rules(RELAY_PORT, RELAY_MARK, table=DELAY_TABLE))

    def delay(self, host: str, ms: int) -> None:
        """Hold every chunk into and out of ``host`` for ``ms`` (0: no delay)."""
        p = self.relays[host]
        if p.poll() is not None:
            raise OSError(f"the delaying relay of {host} exited with {p.returncode}")
        p.stdin.write(f"{ms}\n".encode())
        p.stdin.flush()

    def lose(self, host: str, percent: int) -> None:
        """Drop ``percent`` % of the packets into and out of ``host``, at random, both ways."""
        ns = self.hosts[host][0]
        drop = f"numgen random mod 100 < {percent} drop"
        _nft(ns, f"table ip {LOSS_TABLE} {{\n"
                 f"  chain in {{ type filter hook input priority 0; policy accept; iifname \"eth0\" {drop}; }}\n"
                 f"  chain out {{ type filter hook output priority 0; policy accept; oifname \"eth0\" {drop}; }}\n"
                 f"}}\n")

    def unlose(self, host: str) -> None:
        ns = self.hosts[host][0]
        r = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "tables"], capture_output=True, text=True)
        if f"table ip {LOSS_TABLE}" in r.stdout:
            _nft(ns, f"delete table ip {LOSS_TABLE}\n")

    def relay_pids(self) -> set[int]:
        return {p.pid for p in self.relays.values() if p.poll() is None}

    def close(self) -> None:
        if not self.up:
            return
        for p in self.relays.values():
            with contextlib.suppress(OSError):
                p.stdin.close()  # end of stdin: the relay stops
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        self.relays.clear()
        for ns, veth, _ in self.hosts.values():
            _ip("netns", "del", ns, check=False)  # its veth pair goes with it, but not at once:
            _ip("link", "del", veth, check=False)  # the next network of this tag must not find it
        _ip("link", "del", self.bridge, check=False)
        self.up = False

    def release(self) -> None:
        """Give the tag back, once closed for good (its lock also ends with this process)."""
        if self._claim is not None:
            os.close(self._claim)
            self._claim = None


def _tc(*args: str, check: bool = True) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise OSError(f"tc {' '.join(args)}: {r.stderr.strip()}")


def _nft(ns: str, script: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"nft in {ns}: {r.stderr.strip()}")


def _ip(*args: str, check: bool = True) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip()}")


_TAGS = 250  # a tag names the namespaces, the bridge and the subnet 10.231.<tag>: at most 250 soaks at once


def claim_tag() -> tuple[int, int]:
    """(a tag, the descriptor of its lock): a tag no other soak on this machine holds now (two pytest
    workers run soaks side by side; tags from their pids overlapped and each took the other's
    namespaces for its own leftovers), nor left namespaces of. The lock (flock) ends with the process."""
    import fcntl

    d = Path(tempfile.gettempdir()) / "mtc-soak-tags"
    d.mkdir(exist_ok=True)
    taken = {n.split("-")[2] for n in leftover_netns()}
    links = {p.name for p in Path("/sys/class/net").iterdir()} if Path("/sys/class/net").is_dir() else set()
    for i in range(_TAGS):
        tag = (os.getpid() + i) % _TAGS
        if str(tag) in taken or f"mtsb{tag}" in links or any(n.startswith(f"mtsv{tag}-") for n in links):
            continue  # namespaces or links of this tag are still there (a veth goes a little after its netns)
        fd = os.open(d / str(tag), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return tag, fd
    raise OSError(f"every soak network tag is held or has namespaces left (ip netns list | grep mtc-soak-)")


def leftover_netns(tag_prefix: str = "mtc-soak-") -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(tag_prefix)]


# --- the head process -----------------------------------------------------------------------------


class HeadProc:
    """One ``soak_head.py`` process: JSON-line calls with a deadline; SIGKILL to crash it."""

    def __init__(self, seed: int, workdir: Path, env: dict, log_path: Path):
        setpriv = shutil.which("setpriv")  # the head dies with the soak, whatever happens to it
        argv = [sys.executable, str(HEAD_SCRIPT), str(seed), str(workdir)]
        if setpriv:
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=env, cwd=workdir)
        self._buf = b""
        self.pid = self.proc.pid
        ready = self._read(CALL_TIMEOUT_S)
        if "ready" not in ready:
            raise HeadDied(f"head did not start: {ready}")

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Violation(f"the head did not answer within {timeout:.0f} s (hung); log {self.log_path}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise HeadDied(f"head pid {self.pid} exited with {self.proc.wait()}; log {self.log_path}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, op: str, **args) -> None:
        try:
            self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise HeadDied(f"head pid {self.pid} is gone") from e

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args) -> dict:
        self.send(op, **args)
        return self._read(timeout)

    def answer(self, timeout: float = CALL_TIMEOUT_S) -> dict:
        return self._read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("close", timeout=60)
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


# --- the backup tier, read and corrupted from outside mtc -----------------------------------------


class BackupView:
    """The backup root's objects (``blobs/``, ``backups/``) as a reader outside mtc sees them."""

    def __init__(self, kind: str, root: Path | None = None, server: EmulatorServer | None = None,
                 prefix: str = ""):
        self.kind, self.root, self.server, self.prefix = kind, root, server, prefix
        self.up = True
        self.bucket_lost = 0

    def _bucket(self):
        return self.server.client().bucket(BUCKET)

    def list(self, sub: str) -> list[str]:
        if self.kind == "local":
            d = self.root / sub
            return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []
        from google.api_core.exceptions import NotFound

        pre = f"{self.prefix}/{sub}/"
        try:
            return sorted(b.name[len(pre):] for b in self._bucket().list_blobs(prefix=pre))
        except NotFound:
            # fake-gcs-server (filesystem backend) has been seen to come back from a restart without
            # the bucket: an emulator fault, not mtc's. Re-create it (its objects are gone: the oracle
            # and mtc both see no backups then) and say so in the notes.
            self.bucket_lost += 1
            self.server._ensure_bucket(BUCKET)
            return []

    def read(self, name: str) -> bytes | None:
        if self.kind == "local":
            try:
                return (self.root / name).read_bytes()
            except FileNotFoundError:
                return None
        from google.api_core.exceptions import NotFound

        try:
            return self._bucket().blob(f"{self.prefix}/{name}").download_as_bytes()
        except NotFound:
            return None

    def write(self, name: str, data: bytes) -> None:
        if self.kind == "local":
            p = self.root / name
            tmp = p.with_name(f".soak-{p.name}")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        else:
            self._bucket().blob(f"{self.prefix}/{name}").upload_from_string(data)


def parts_of(manifest: bytes) -> dict[str, set[str]]:
    """host -> the blobs of its own shards, from a step file (parsed here, not by mtc: the oracle is
    independent). A step manifest (mtc/3) is a header line and one line per host part; a host that
    does not keep the whole manifest commits a record with its own part only."""
    lines = manifest.split(b"\n")
    doc = json.loads(lines[0])
    if len(lines) > 1:
        parts = [json.loads(line) for line in lines[1:]]
    else:  # a commit record: its own part, as a JSON string
        parts = [json.loads(doc["part"])] if isinstance(doc.get("part"), str) else []
    return {p.get("host", ""): _part_blobs(p) for p in parts}


def _part_blobs(part: dict) -> set[str]:
    """The blob names of one part: rows of ``[array, box, blob, nbytes]`` (mtc-host/1), or columns
    (mtc-host/2: ``rows`` rows packed in base64, 4 + 4 + 8 bytes of each row first, then 16 bytes
    of blob name per row)."""
    if part.get("format") == "mtc-host/2":
        n, packed = part["rows"], base64.b64decode(part["columns"], validate=True)
        if len(packed) != 32 * n:
            raise ValueError(f"part of {part.get('host')}: {len(packed)} bytes of columns for {n} rows")
        return {packed[16 * n + 16 * i:16 * n + 16 * (i + 1)].hex() for i in range(n)}
    return {row[2] for row in part.get("shards", ())}


def blobs_of(manifest: bytes) -> set[str]:
    """Every blob a step file names."""
    return set().union(*parts_of(manifest).values())


def good(name: str, data: bytes | None) -> bool:
    return data is not None and xxhash.xxh3_128(data).hexdigest() == name


def flip(data: bytes, r: random.Random) -> tuple[bytes, int]:
    i = r.randrange(len(data))
    b = bytearray(data)
    b[i] ^= 1 << r.randrange(8)
    return bytes(b), i


# --- results --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ClassStats:
    injected: int = 0
    inject_failed: int = 0  # trials whose injection raised (recorded, the cluster healed, then checked)
    survived: int = 0
    restores: int = 0
    wrong: int = 0
    lost: int = 0
    recover_s: list = dataclasses.field(default_factory=list)


class Soak:
    """One soak run (see the module docstring)."""

    def __init__(self, seed: int, workdir: Path, *, trials_per_segment: int = 24, segments=SEGMENTS,
                 out=print, only: list[str] | None = None, keep: bool = False):
        self.only = set(only or FAULT_CLASSES)
        self.keep = keep
        self.seed = seed
        self.workdir = workdir
        self.trials_per_segment = trials_per_segment
        self.segments = list(segments)
        self.out = out
        self.stats = {c: ClassStats() for c in FAULT_CLASSES}
        self.schedule: list[str] = []
        self.notes: dict[str, int] = {}
        self.trial = 0
        self.class_rng = random.Random(seed)
        self.counts = {c: 0 for c in FAULT_CLASSES}
        self.could_draw: set[str] = set()
        self.cannot: dict[str, str] = {}  # class -> why a segment could not draw it
        # Children this process had before the soak (a test session's emulator fixture) are not the soak's.
        self.networks: list[HostNetwork] = []  # its segments' networks: their tags, for the leftover check
        self.preexisting = {c.pid for c in psutil.Process().children(recursive=True)}  # classes some segment could inject (no root: fewer)
        self.max_seen = {"fds": 0, "sockets": 0, "temp_blobs": 0}
        self.mounts: list[Path] = []
        self.bucket_lost = 0

    # --- segment lifecycle ------------------------------------------------------------------------

    def run(self, deadline: float | None = None, max_trials: int | None = None) -> None:
        k = 0
        while True:
            if max_trials is not None and self.trial >= max_trials:
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            topo, backend = self.segments[k % len(self.segments)]
            self._segment(k, topo, backend, deadline, max_trials)
            k += 1
            if k >= len(self.segments) and not self.could_draw:  # a whole pass, and no trial could run
                raise CannotDraw("no fault class this run may draw can be injected here: " + "; ".join(
                    f"{c} {why}" for c, why in sorted(self.cannot.items())))
            if deadline is None and max_trials is None and k >= len(self.segments):
                return

    def _segment(self, k: int, topo: tuple[int, int], backend: str, deadline, max_trials) -> None:
        slices, hosts = topo
        self.label = f"seg {k} {slices}x{hosts}/{backend}"
        seg = self.workdir / f"seg{k}"
        seg.mkdir()
        self.seg = seg
        self.out(f"--- {self.label}: {seg}")
        self.server = None
        self.cluster = None
        self.head = None
        self.step = 0
        self.digests: dict[int, str] = {}
        self.committed: dict[int, set[str]] = {}
        self.saved_on: dict[int, int] = {}  # step -> how many hosts the head that saved it had
        self.failed: set[int] = set()
        self.corrupt: set[tuple[str, str]] = set()  # (host or "backup", path) of manifests the soak corrupted
        self.save_s = 0.5
        self.repairs: list[Callable[[], None]] = []
        self.skip_recovery_time = False
        # (host, blob) the soak corrupted: a host that finds its copy corrupt removes it, and may keep
        # the step committed without it (the step stays whole while a copy is left elsewhere).
        self.flipped: set[tuple[str, str]] = set()
        self.backup_verified: set[str] = set()
        env: dict[str, str] = {}
        self.net = None
        try:
            root = seg / "cluster"
            root.mkdir()
            names = [f"s{s}-h{h}" for s in range(slices) for h in range(hosts)]
            self.tmpfs = self._mount_ramdisks(root, names)
            if self.tmpfs and shutil.which("ip"):
                net = None
                try:
                    net = HostNetwork(None, names)
                    self.networks.append(net)  # its tag is held until the leftover check (run_soak)
                    self.net = net.start()
                except OSError as e:
                    self.out(f"  (no network namespaces: {e}; net_cut is not drawn)")
                    if net is not None:
                        net.close()
                if self.net is not None and not self.net.nft:
                    self.out("  (no nft: install nftables; net_loss and net_latency are not drawn)")
                elif self.net is not None and "net_latency" in self.only:
                    try:
                        self.net.start_relays(seg)
                    except OSError as e:
                        self.out(f"  (no delaying relay: {e}; net_latency is not drawn)")
                        self.net.close()
                        self.net = net.start()
            if backend == "gcs":
                (seg / "gcs").mkdir()
                self.server = EmulatorServer(FAKE_GCS, seg / "gcs", persistent=True, default_bucket=BUCKET,
                                             host=self.net.gateway if self.net else "127.0.0.1")
                self.server.start()
                env["STORAGE_EMULATOR_HOST"] = self.server.url
                base = f"gs://{BUCKET}/base"
                self.backup = BackupView("gcs", server=self.server, prefix=f"base/{RUN}/mtc")
            else:
                base = str(seg / "backup")
                self.backup = BackupView("local", root=seg / "backup" / RUN / "mtc")
            self.cluster = LocalCluster(root, slices, hosts, devices_per_host=DEVICES_PER_HOST,
                                        env=env, launch=self.net.launch if self.net else None).start()
            self.config = dict(local_checkpoint_directory=str(root), local_checkpoint_period=1,
                               base_output_directory=base, run_name=RUN,
                               multi_tier_checkpointing_backup_interval_steps=1, backup_max_to_keep=3,
                               local_max_to_keep=2, replication_factor=2)
            self.head_env = {**os.environ, **env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                             "JAX_PLATFORMS": "cpu"}
            self.live = list(self.cluster.hosts)
            self._new_head()
            for _ in range(2):
                self._clean_save()
            n = 0
            if not self._available():
                why = self._unavailable()
                self.cannot.update({c: why[c] for c in why if c not in self.could_draw})
                self.out("  (nothing to draw on this segment: " + "; ".join(f"{c} {r}" for c, r in sorted(why.items()))
                         + ")")
            while n < self.trials_per_segment and self._available():
                if max_trials is not None and self.trial >= max_trials:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._one_trial()
                n += 1
        finally:
            self._teardown_segment()

    def _mount_ramdisks(self, root: Path, names: list[str]) -> bool:
        ok = True
        for h in names:
            d = root / h
            d.mkdir()
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={RAMDISK_MB}m", "tmpfs", str(d)],
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.mounts.append(d)
            else:
                ok = False
        if not ok:
            self.out("  (no root: ramdisks are plain folders; ramdisk_full is not drawn)")
        return ok

    def _teardown_segment(self) -> None:
        if getattr(self, "backup", None) is not None:
            self.bucket_lost += self.backup.bucket_lost
            self.backup.bucket_lost = 0
        if self.head is not None:
            self.head.kill()
            self.head = None
        if self.cluster is not None:
            self.cluster.stop()
        if self.server is not None:
            self.server.stop()
        if getattr(self, "net", None) is not None:
            self.net.close()
        for d in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(d)], check=False, capture_output=True)
        self.mounts.clear()
        if not self.keep:
            shutil.rmtree(self.seg, ignore_errors=True)

    # --- the head -------------------------------------------------------------------------------

    def _new_head(self, hosts: list[str] | None = None) -> None:
        if self.head is not None:
            self.head.kill()
        self.head = HeadProc(self.seed, self.seg, self.head_env, self.seg / "head.log")
        self._open(hosts or self.live)

    def _open(self, hosts: list[str]) -> None:
        self.live = list(hosts)
        a = self.head.call("open", spec=str(self.cluster.spec_path), hosts=self.live, config=self.config)
        if not a["ok"]:
            raise Violation(f"a new manager on {hosts} failed: {a['error']}: {a['message']}")

    def _save(self, step: int) -> dict:
        self.digests[step] = soak_state.digest(soak_state.state(self.seed, step))
        a = self.head.call("save", step=step)
        if a["ok"] and a["digest"] != self.digests[step]:
            raise Violation(f"step {step}: the head saved a state whose digest differs from the soak's")
        return a

    def _wait(self, step: int, timeout: float = CALL_TIMEOUT_S) -> dict:
        a = self.head.call("wait", timeout=timeout)
        if a["ok"]:
            self.committed[step] = self._blobs_on_disk(step)
            self.saved_on[step] = len(self.live)
        else:
            self.failed.add(step)
        return a

    def _save_wait(self) -> dict:
        self.step += 1
        t0 = time.perf_counter()
        a = self._save(self.step)
        if not a["ok"]:
            self.failed.add(self.step)
            return a
        a = self._wait(self.step)
        if a["ok"]:
            self.save_s = 0.7 * self.save_s + 0.3 * (time.perf_counter() - t0)
        return a

    def _clean_save(self, why: str = "a save with no fault") -> None:
        a = self._save_wait()
        if not a["ok"]:
            raise Violation(f"{why} failed (step {self.step}): {a['error']}: {a['message']}")

    def _blobs_on_disk(self, step: int) -> set[str]:
        """The blobs of ``step``: from a host that keeps its whole manifest, else from every
        host's own part (hosts that are not keepers commit a record with their part only)."""
        union: set[str] = set()
        seen = False
        for h in self.live:
            p = self._step_file(h, step)
            if p.exists():
                data = p.read_bytes()
                seen = True
                if b"\n" in data:
                    return blobs_of(data)
                union |= blobs_of(data)
        if not seen:
            raise Violation(f"step {step} was reported saved but no host holds steps/{step}")
        return union

    def _step_file(self, host: str, step: int) -> Path:
        d = self.cluster.store_root(host) / "steps"
        for p in d.glob(f"*{step}.json") if d.is_dir() else ():
            if _step_of(p) == step:
                return p
        return d / f"{step:012d}.json"

    # --- the oracle -----------------------------------------------------------------------------

    def _reachable(self) -> list[str]:
        return [h for h in self.live if self.cluster.is_running(h)]

    def _ram_blobs(self, host: str) -> dict[str, Path]:
        d = self.cluster.store_root(host) / "blobs"
        if not d.is_dir():
            return {}
        return {p.name: p for p in d.iterdir() if not p.name.startswith(".")}

    def _backup_manifests(self) -> dict[str, bytes]:
        if not self.backup.up:
            return {}
        out = {}
        for name in self.backup.list("backups"):
            if name.endswith(".json"):
                data = self.backup.read(f"backups/{name}")
                if data is not None:
                    out[name] = data
        return out

    def _intact_steps(self) -> tuple[dict[int, str], set[str]]:
        """Committed steps with every blob good somewhere reachable -> where the manifest is."""
        good_blobs: set[str] = set()
        manifests: dict[int, str] = {}
        for h in self._reachable():
            for name, p in self._ram_blobs(h).items():
                with contextlib.suppress(OSError):
                    if good(name, p.read_bytes()):
                        good_blobs.add(name)
            d = self.cluster.store_root(h) / "steps"
            for p in (d.iterdir() if d.is_dir() else ()):
                s = _step_of(p)
                if s is not None and (h, str(p)) not in self.corrupt:
                    manifests.setdefault(s, h)
        backup_blobs: set[str] = set()
        present = set(self.backup.list("blobs")) if self.backup.up else set()
        for name, data in self._backup_manifests().items():
            if ("backup", name) in self.corrupt:
                continue
            try:
                step = json.loads(data.split(b"\n")[0])["step"]
                names = blobs_of(data)
            except (ValueError, KeyError, TypeError):
                continue
            ok = all(self._good_backup_blob(b, present) for b in names)
            if ok:
                backup_blobs |= names
                manifests.setdefault(step, "backup")
        intact = {s: where for s, where in manifests.items()
                  if s in self.committed and self.committed[s] <= (good_blobs | backup_blobs)}
        return intact, good_blobs | backup_blobs

    def _good_backup_blob(self, name: str, present: set[str]) -> bool:
        if name not in present:
            return False
        if name not in self.backup_verified and good(name, self.backup.read(f"blobs/{name}")):
            self.backup_verified.add(name)  # the soak is the only corrupter; it forgets what it flips
        return name in self.backup_verified

    # --- the checks -----------------------------------------------------------------------------

    def check(self, cls: str, t_fault: float, *, expect_backup: bool = True) -> None:
        st = self.stats[cls]
        steps = self._ok(self.head.call("steps"), "steps")
        listed = set(steps["all"])
        unknown = listed - set(self.digests)
        if unknown:
            raise Violation(f"steps {sorted(unknown)} are listed but were never saved")
        bad = listed & self.failed
        if bad:
            raise Violation(f"steps {sorted(bad)} are listed although their save failed")
        intact, _ = self._intact_steps()
        want = max(intact, default=None)
        r = self.head.call("restore", step=None)
        if not r["ok"]:
            chosen = steps["latest"]
            if want is not None and chosen is not None and chosen <= want:
                raise Violation(f"restore of the latest step {chosen} failed although step {want} has a good copy "
                                f"of every blob ({intact[want]}): {r['error']}: {r['message']}")
            if want is None and r["error"] not in ("CorruptBlobError", "StepNotFoundError"):
                raise Violation(f"restore failed with {r['error']} (no intact step, but that is not the error "
                                f"that says so): {r['message']}")
            if r["error"] == "CorruptBlobError" and "tiers" not in r["message"] and "tried" not in r["message"]:
                raise Violation(f"a corrupt only copy failed the restore with a message that does not name the "
                                f"tiers tried: {r['message']}")
            self._note("latest step had no good copy: restore failed, older step restored")
            if want is not None:
                r = self._ok(self.head.call("restore", step=want), f"restore of intact step {want}")
        st.restores += 1
        got = r.get("step")
        if got is None:
            if want is not None:
                st.lost += 1
                raise Violation(f"nothing restored, but step {want} is committed and intact ({intact[want]})")
        else:
            if r["digest"] != self.digests.get(got):
                st.wrong += 1
                raise Violation(f"restore of step {got} is not what was saved (digest differs); "
                                f"report {r['bytes_by_tier']}")
            if r["wrong_sharding"]:
                st.wrong += 1
                raise Violation(f"restore of step {got}: wrong shardings for {r['wrong_sharding']}")
            if want is not None and got < want:
                st.lost += len([s for s in intact if s > got])
                raise Violation(f"restored step {got}, but step {want} is committed and intact ({intact[want]})")
        if not self.skip_recovery_time:
            st.recover_s.append(time.perf_counter() - t_fault)
        self.skip_recovery_time = False
        self.last_restore = r
        self._check_disk()
        self._check_leaks()

    def _ok(self, a: dict, what: str) -> dict:
        if not a["ok"]:
            raise Violation(f"{what} failed: {a['error']}: {a['message']}\n{a.get('traceback', '')}")
        return a

    def _check_disk(self) -> None:
        """No host keeps a failed step or a committed step without its own blobs; no backup lacks a blob;
        no pending step or temp blob is left over once the head has reached every host."""
        hosts = self.cluster.hosts
        for h in hosts:
            root = self.cluster.store_root(h)
            held = set(self._ram_blobs(h))
            d = root / "steps"
            for p in (d.iterdir() if d.is_dir() else ()):
                s = _step_of(p)
                if s is None or (h, str(p)) in self.corrupt:
                    continue
                # A step saved on fewer hosts (a lost slice), restored onto all of them later, is committed
                # again on a host that holds what its new shards need, not the saved "own" share.
                own_share = self.saved_on.get(s) == len(hosts)
                if h in self._reachable() and s in self.failed:
                    raise Violation(f"{h} keeps step {s} committed although its save failed")
                try:
                    need = parts_of(p.read_bytes()).get(h, set())
                except (OSError, ValueError):
                    continue  # removed or replaced while we read it
                missing = need - held - {b for hh, b in self.flipped if hh == h}
                if own_share and missing and p.exists():
                    raise Violation(f"{h}: step {s} is committed without its blobs {sorted(missing)[:3]}")
            if h in self._reachable():
                pend = root / "pending"
                left = [p.name for p in pend.iterdir()] if pend.is_dir() else []
                if left:
                    self._note(f"pending step folder left after recovery")
                temps = len(list((root / "blobs").glob(".tmp-*"))) if (root / "blobs").is_dir() else 0
                self.max_seen["temp_blobs"] = max(self.max_seen["temp_blobs"], temps)
                if temps > MAX_TEMP_BLOBS:
                    raise Violation(f"{h} has {temps} temp blobs (a leak)")
        self._check_backups()

    def _check_backups(self) -> None:
        """No backup manifest is listed without all its blobs.

        Backups change in the background while the soak looks: a sidecar can still be finishing
        a backup for a head that was killed, and retention removes a backup's manifest first and
        its blobs after (``BackupTier._retain``). So the blobs are listed after the manifests, and
        a backup counts as listed without its blobs only if its manifest is still there after that
        listing: then it was listed the whole time its blobs were missing (manifests are
        create-only, their names never reused)."""
        before = self._backup_manifests()
        present = set(self.backup.list("blobs")) if self.backup.up else set()
        after = set(self.backup.list("backups")) if self.backup.up else set()
        for name, data in before.items():
            if ("backup", name) in self.corrupt:
                continue
            try:
                names = blobs_of(data)
            except (ValueError, KeyError, TypeError) as e:
                raise Violation(f"backup {name} is listed but its manifest does not parse: {e}") from e
            if names - present:
                if name not in after:
                    self._note("a backup was pruned while the soak checked it")
                    continue
                gone = sorted(names - present)
                readable = [b for b in gone[:3] if self.backup.read(f"blobs/{b}") is not None]
                raise Violation(f"backup {name} is listed without its blobs {gone[:3]} ({len(gone)} missing; "
                                f"{len(readable)} of the first {min(3, len(gone))} still readable by name: "
                                f"{'a listing that left them out' if readable else 'deleted'})")

    def _check_leaks(self) -> None:
        expected = {p for h, p in self.cluster.pids().items() if self.cluster.is_running(h)}
        expected.add(self.head.pid)
        if self.server is not None and self.server.proc is not None:
            expected.add(self.server.proc.pid)
        if self.net is not None:
            expected |= self.net.relay_pids()
            gone = sorted(h for h, p in self.net.relays.items() if p.poll() is not None)
            if gone:  # the soak's own part: every connection to that host would be refused from now on
                raise Violation(f"the soak's delaying relay of {gone} exited; log {self.seg}/relay-{gone[0]}.log")
        for c in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if c.status() != psutil.STATUS_ZOMBIE and c.pid not in expected | self.preexisting:
                    raise Violation(f"a process was left behind: pid {c.pid} {c.cmdline()[:4]}")
        for h in self._reachable():
            fds, socks = _fds(self.cluster.pid(h))
            self.max_seen["fds"] = max(self.max_seen["fds"], fds)
            self.max_seen["sockets"] = max(self.max_seen["sockets"], socks)
            if fds > MAX_DAEMON_FDS or socks > MAX_DAEMON_SOCKETS:
                raise Violation(f"{h}: {fds} open files, {socks} sockets (a leak)")

    def _note(self, what: str) -> None:
        self.notes[what] = self.notes.get(what, 0) + 1

    # --- trials ---------------------------------------------------------------------------------

    def _available(self) -> list[str]:
        return [c for c in FAULT_CLASSES if c in self.only and c not in self._unavailable()]

    def _unavailable(self) -> dict[str, str]:
        """class -> why it cannot be injected on this segment, for the classes the run may draw."""
        out = {}
        for c in FAULT_CLASSES:
            if c not in self.only:
                continue
            if c in GCS_ONLY and self.server is None:
                out[c] = "needs a GCS segment (this one backs up to a local folder)"
            elif c == "ramdisk_full" and not self.tmpfs:
                out[c] = "needs root, to mount a tmpfs ramdisk per host"
            elif c in NET_CLASSES and self.net is None:
                out[c] = "needs root and iproute2 (ip), for a network namespace per host"
            elif c in NFT_CLASSES and not self.net.nft:
                out[c] = "needs nftables (apt-get install nftables)"
            elif c == "net_latency" and not self.net.relays:
                out[c] = "needs the delaying relay, which did not start (see the segment's note)"
        return out

    def _one_trial(self) -> None:
        avail = self._available()
        self.could_draw |= set(avail)
        low = min(self.counts[c] for c in avail)
        cls = self.class_rng.choice([c for c in avail if self.counts[c] == low])
        self.counts[cls] += 1
        r = random.Random(f"{self.seed}/{self.trial}")
        detail: dict = {}
        line = f"[{self.label}] trial {self.trial} {cls}"
        self.schedule.append(line)
        t_start = time.perf_counter()
        try:
            for _ in range(r.randint(0, 1)):
                self._clean_save("a save between faults")
            t_fault = time.perf_counter()
            failed = self._inject(cls, r, detail)
            self.check(cls, t_fault)
            while self.repairs:  # the fault ends: the soak puts back the bytes it corrupted
                self.repairs.pop()()
            self._clean_save(f"the first save after {cls}")
        except Violation as v:
            self.schedule[-1] = f"{line} {detail}"
            raise Violation(f"{line} {detail}: {v}") from None
        except HeadDied as e:
            self.schedule[-1] = f"{line} {detail}"
            raise Violation(f"{line} {detail}: the head died unexpectedly: {e}") from None
        st = self.stats[cls]
        if failed is None:
            st.injected += 1
        st.survived += 1
        self.schedule[-1] = f"{line} {detail}"
        rep = self.last_restore
        tiers = " ".join(f"{k} {v / 1e6:.1f}M" for k, v in rep.get("bytes_by_tier", {}).items() if v)
        self.out(f"{line} {detail} -> restored step {rep.get('step')} ({tiers or 'nothing moved'}) "
                 f"in {st.recover_s[-1]:.1f} s [{time.perf_counter() - t_start:.1f} s]")
        self.trial += 1

    def _inject(self, cls: str, r: random.Random, d: dict) -> str | None:
        """Inject the fault of ``cls``; None, or why the injection failed.

        A broken invariant (``Violation``) or a head that died still ends the run. Any other exception
        comes from the soak's own injecting (ENOSPC creating a filler on a ramdisk that is already full,
        a process already gone, an ``ip`` or mount command refused): it is recorded as this trial's
        outcome (the table's "injection failed", the notes, the schedule), what the fault may have left
        half done is put back, and the trial goes on to its checks."""
        try:
            FAULTS[cls.split(":")[0]](self, r, cls, d)
            return None
        except (Violation, HeadDied):
            raise
        except Exception as e:  # noqa: BLE001 - the harness survives its injections
            why = f"{type(e).__name__}: {e}"
            d["injection_failed"] = why
            self.stats[cls].inject_failed += 1
            self._note(f"{cls}: the injection failed ({why})")
            self.out(f"  {cls}: the injection failed, recorded ({why}); healing, then the checks")
            self._heal()
            return why

    def _heal(self) -> None:
        """After a failed injection: bring back what a fault may have left down (hosts, the bucket, a
        link, a filler file, the head, the hosts the head drives), as its own cleanup would have. A step
        that fails is noted; the checks that follow judge the cluster as it is."""
        steps: list[tuple[str, Callable[[], None]]] = []
        for h in self.cluster.hosts:
            steps.append((f"remove the filler on {h}", lambda h=h: (self.cluster.ramdisk(h) / "filler").unlink(
                missing_ok=True)))
            if self.net is not None:
                steps.append((f"bring {h}'s link up", lambda h=h: self.net.heal(h)))
                if self.net.nft:
                    steps.append((f"end the loss on {h}'s link", lambda h=h: self.net.unlose(h)))
                if h in self.net.relays:
                    steps.append((f"end the delay on {h}'s link", lambda h=h: self.net.delay(h, 0)))
            steps.append((f"restart {h}", lambda h=h: None if self.cluster.is_running(h) else self.cluster.restart(h)))
        if self.server is not None and not self.backup.up:
            steps.append(("restart the bucket", lambda: (self.server.start(), setattr(self.backup, "up", True))))
        for what, fn in steps:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - noted; the checks judge what is left
                self._note(f"heal after a failed injection: could not {what} ({type(e).__name__}: {e})")
        if self.head is None:
            self._new_head(self.cluster.hosts)
        elif sorted(self.live) != sorted(self.cluster.hosts):
            self._open(self.cluster.hosts)

    def summary_rows(self) -> list[list[str]]:
        rows = []
        for c in FAULT_CLASSES:
            s = self.stats[c]
            t = s.recover_s
            rows.append([c, str(s.injected), str(s.inject_failed), str(s.survived), str(s.restores), str(s.wrong),
                         str(s.lost), f"{statistics.median(t):.1f}" if t else "-", f"{max(t):.1f}" if t else "-"])
        return rows


def _fds(pid: int) -> tuple[int, int]:
    """(open files, of which sockets) of a process, from /proc (in any network namespace)."""
    n = socks = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += 1
            socks += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n, socks


def _step_of(p: Path) -> int | None:
    stem = p.name[:-5] if p.name.endswith(".json") else None
    return int(stem) if stem and stem.isdigit() else None


# --- the faults -----------------------------------------------------------------------------------
# Each injects its fault, heals what a scheduler or operator would, and leaves the cluster with every
# host of the head's spec up; Soak.check then judges. ``d`` collects the trial's parameters (printed).


def _kill_later(delay: float, fn: Callable[[], None]) -> threading.Thread:
    t = threading.Timer(delay, fn)
    t.start()
    return t


def fault_kill_sidecar(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    victim = r.choice(s.live)
    delay = round(r.uniform(0, 1.5) * s.save_s, 3)
    d.update(host=victim, after_s=delay)
    s.step += 1
    a = s._save(s.step)
    killer = _kill_later(delay, lambda: s.cluster.kill(victim))
    if a["ok"]:
        a = s._wait(s.step)
    else:
        s.failed.add(s.step)
    killer.join()
    if not a["ok"] and set(a["hosts"]) - {victim}:
        raise Violation(f"the save failed on {a['hosts']}, but only {victim} was killed: {a['message']}")
    d["save"] = "ok" if a["ok"] else "failed"
    s.cluster.kill(victim)
    s.cluster.restart(victim)


def fault_crash(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    point = cls.split(":", 1)[1]
    victim = r.choice(s.live)
    d.update(host=victim)
    if point == "between_uploads":  # so that this step's backup is not skipped as due while one runs
        s.head.call("wait_backup")
    s.cluster.restart(victim, env={"MTC_CRASH_AT": point})
    a = s._save_wait()
    if point == "between_uploads" and a["ok"]:
        b = s.head.call("wait_backup")
        d["backup"] = "ok" if b["ok"] else "failed"
    try:  # the crash point kills with SIGKILL; the kernel may reap it a moment after the head noticed
        reached = s.cluster.wait(victim, timeout=0.5 if point == "between_uploads" else 5) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        reached = False
    d["reached"] = reached
    if point != "between_uploads" and a["ok"]:
        raise Violation(f"the save succeeded although {victim} was to die at {point}")
    if not reached:
        s._note(f"{point}: not reached on the victim (it uploaded nothing)")
    s.cluster.kill(victim)
    s.cluster.restart(victim)


def fault_kill_head(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    delay = round(r.uniform(0, 2.0) * s.save_s, 3)
    d.update(after_s=delay)
    s.step += 1
    s._save(s.step)
    time.sleep(delay)  # a random moment inside the save, replication or backup
    s.head.kill()
    s.head = None
    s._new_head()


def _wipe(s: Soak, hosts: list[str], live: bool) -> None:
    for h in hosts:
        if live:  # under the running daemon, as an operator's rm -rf or a tmpfs remount would
            for p in s.cluster.ramdisk(h).iterdir():
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        else:
            s.cluster.wipe(h)
            s.cluster.restart(h)


def fault_wipe_host(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    victim, live = r.choice(s.live), r.random() < 0.5
    d.update(host=victim, live=live)
    _wipe(s, [victim], live)


def fault_wipe_slice(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    c = s.cluster
    if c.num_slices > 1:
        sl = r.randrange(c.num_slices)
        hosts = [h for h in c.hosts if c.slice_of(h) == sl]
    else:  # one slice: half of its hosts (the whole slice is wipe_all)
        hosts = r.sample(c.hosts, len(c.hosts) // 2)
    live = r.random() < 0.5
    d.update(hosts=hosts, live=live)
    _wipe(s, hosts, live)


def fault_wipe_all(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    waited = r.random() < 0.7
    live = r.random() < 0.5
    d.update(backup_waited=waited, live=live)
    if waited:
        s.head.call("wait_backup")
    _wipe(s, s.cluster.hosts, live)


def _latest_committed(s: Soak) -> int:
    return max(s.committed)


def _owners(s: Soak, step: int) -> dict[str, set[str]]:
    """blob -> hosts whose own shards of ``step`` are that blob."""
    for h in s._reachable():
        p = s._step_file(h, step)
        if p.exists():
            parts = parts_of(p.read_bytes())
            if len(parts) < 2 and len(s._reachable()) > 1:
                continue  # this host's record has its own part only
            out: dict[str, set[str]] = {}
            for host, blobs in parts.items():
                for b in blobs:
                    out.setdefault(b, set()).add(host)
            return out
    return {}


def _flip_file(s: Soak, p: Path, r: random.Random, corrupt_key=None) -> tuple[bytes, int]:
    data = p.read_bytes()
    bad, i = flip(data, r)
    with open(p, "r+b") as f:  # in place: the same inode, as bit rot would
        f.seek(i)
        f.write(bad[i:i + 1])
    if corrupt_key:
        s.corrupt.add(corrupt_key)

    def repair() -> None:
        s.corrupt.discard(corrupt_key)
        with contextlib.suppress(FileNotFoundError):
            with open(p, "r+b") as f:
                if len(f.read()) == len(data):
                    f.seek(0)
                    f.write(data)
    s.repairs.append(repair)
    return data, i


def fault_flip_ram_blob(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    step = _latest_committed(s)
    owners = _owners(s, step)
    reachable = s._reachable()
    choices = sorted((b, h) for b, hs in owners.items() for h in hs if h in reachable and b in s._ram_blobs(h))
    if not choices:
        d["skipped"] = "no blob of the latest step on a host"
        return
    blob, host = r.choice(choices)
    p = s._ram_blobs(host)[blob]
    _, i = _flip_file(s, p, r)
    s.flipped.add((host, blob))
    d.update(step=step, host=host, blob=blob[:8], offset=i)


def fault_flip_peer_copy(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    step = _latest_committed(s)
    owners = _owners(s, step)
    s.head.call("wait_replication")
    choices = sorted((b, h) for b, hs in owners.items() if len(hs) == 1
                     for h in s._reachable() if h not in hs and b in s._ram_blobs(h))
    if not choices:
        d["skipped"] = "no peer copy of the latest step"
        s._note("flip_peer_copy: no peer copy found")
        return
    blob, host = r.choice(choices)
    _, i = _flip_file(s, s._ram_blobs(host)[blob], r)
    s.flipped.add((host, blob))
    (owner,) = owners[blob]
    d.update(step=step, host=host, blob=blob[:8], offset=i, owner_replaced=owner)
    # The owner is replaced: the only copy left on the hosts is the corrupt one.
    s.cluster.wipe(owner)
    s.cluster.restart(owner)


def fault_flip_backup_blob(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    b = s.head.call("wait_backup")
    mans = s._backup_manifests()
    if not mans:
        d["skipped"] = "no backup"
        return
    name = max(mans)
    blobs = sorted(blobs_of(mans[name]))
    blob = r.choice(blobs)
    data = s.backup.read(f"blobs/{blob}")
    bad, i = flip(data, r)
    s.backup.write(f"blobs/{blob}", bad)
    s.backup_verified.discard(blob)

    def repair() -> None:
        if s.backup.read(f"blobs/{blob}") is not None:
            s.backup.write(f"blobs/{blob}", data)
    s.repairs.append(repair)
    d.update(backup=name[-17:-5], blob=blob[:8], offset=i, backup_ok=b["ok"])
    # Every ramdisk lost: the backup must serve, and its corrupt blob must not reach the restore.
    _wipe(s, s.cluster.hosts, live=False)


def fault_flip_manifest(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    if r.random() < 0.5:
        step = _latest_committed(s)
        host = r.choice([h for h in s._reachable() if s._step_file(h, step).exists()])
        p = s._step_file(host, step)
        _, i = _flip_file(s, p, r, (host, str(p)))
        d.update(where=host, step=step, offset=i)
    else:
        s.head.call("wait_backup")
        mans = s._backup_manifests()
        if not mans:
            d["skipped"] = "no backup"
            return
        name = max(mans)
        bad, i = flip(mans[name], r)
        s.backup.write(f"backups/{name}", bad)
        s.corrupt.add(("backup", name))
        good_bytes = mans[name]

        def repair() -> None:
            s.corrupt.discard(("backup", name))
            if s.backup.read(f"backups/{name}") is not None:
                s.backup.write(f"backups/{name}", good_bytes)
        s.repairs.append(repair)
        d.update(where="backup", backup=name[-17:-5], offset=i)
        _wipe(s, s.cluster.hosts, live=False)  # so the backup is what a restore must read


def fault_gcs_outage(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    saves = r.randint(1, 3)
    d.update(saves_while_down=saves)
    s.server.stop()
    s.backup.up = False
    try:
        for _ in range(saves):
            t0 = time.perf_counter()
            s._clean_save("a save while the bucket is down")
            if time.perf_counter() - t0 > 60:
                raise Violation(f"a save took {time.perf_counter() - t0:.0f} s while the bucket was down")
    finally:
        s.server.start()
        s.backup.up = True
    s._clean_save("a save after the bucket came back")
    b = s.head.call("wait_backup")
    d["backup_after"] = "ok" if b["ok"] else b["error"]


def fault_gcs_outage_head_restart(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    t0 = time.perf_counter()
    s.head.kill()
    s.head = None
    s.server.stop()
    s.backup.up = False
    try:
        s._new_head()
        s.check(cls, t0)  # restores from the hosts while the bucket is down: the recovery
        s.skip_recovery_time = True  # (the check after the bucket is back includes the backup's backoff)
    finally:
        s.server.start()
        s.backup.up = True
    s._clean_save("a save after the bucket came back")
    b = s.head.call("wait_backup")
    d["backup_after"] = "ok" if b["ok"] else b["error"]


def fault_ramdisk_full(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    victim = r.choice(s.live)
    ramdisk = s.cluster.ramdisk(victim)
    st = os.statvfs(ramdisk)
    leave = r.choice([0, 64 << 10, 512 << 10])
    fill = max(0, st.f_bavail * st.f_frsize - leave)
    filler = ramdisk / "filler"
    d.update(host=victim, left_kib=leave >> 10)
    try:
        with open(filler, "wb", buffering=0) as f:  # unbuffered: the write that meets ENOSPC ends the fill
            chunk = b"\0" * (1 << 20)
            while fill > 0:
                try:
                    n = f.write(chunk[:min(fill, len(chunk))])
                except OSError:
                    break
                fill -= n
        a = s._save_wait()
        d["save"] = "ok" if a["ok"] else "failed"
        if not a["ok"]:
            msg = a["message"]
            if "[Errno" in msg and "InsufficientSpace" not in msg and "space" not in msg.lower():
                raise Violation(f"a full ramdisk failed the save with a bare OS error: {msg}")
    finally:
        filler.unlink(missing_ok=True)


def fault_slice_lost(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    c = s.cluster
    if c.num_slices > 1:
        sl = r.randrange(c.num_slices)
        lost = [h for h in c.hosts if c.slice_of(h) == sl]
    else:
        lost = c.hosts[len(c.hosts) // 2:] if r.random() < 0.5 else c.hosts[:len(c.hosts) // 2]
    wiped = r.random() < 0.5  # the hosts come back as new nodes (empty ramdisks) or as they were
    saves = r.randint(1, 2)
    d.update(lost=lost, returned_wiped=wiped, saves_on_fewer=saves)
    s.head.call("wait")
    for h in lost:
        c.kill(h)
    left = [h for h in c.hosts if h not in lost]
    t0 = time.perf_counter()
    s._open(left)  # the job goes on, on fewer hosts: an elastic restore onto fewer devices
    s.check(cls, t0)
    for _ in range(saves):
        s._clean_save("a save on fewer hosts")
    for h in lost:
        if wiped:
            c.wipe(h)
        c.restart(h)
    s._open(c.hosts)  # and back onto every host: the returned ones fill from peers or the backup


def fault_garbage_peer(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    victim = r.choice(s.live)
    host, port = protocol.parse_address(s.cluster.peer_address(victim))
    kinds = ["random", "wrong_token", "no_token", "huge_length", "half_header", "connect_close"]
    plan = [r.choice(kinds) for _ in range(r.randint(4, 10))]
    seeds = [r.randrange(1 << 30) for _ in plan]
    d.update(host=victim, requests=len(plan))
    stop = threading.Event()
    errors: list[str] = []

    def attack() -> None:
        for kind, sd in zip(plan, seeds):
            if stop.is_set():
                return
            try:
                _send_garbage(host, port, kind, random.Random(sd))
            except OSError:
                pass  # refused and closed: what the server should do
            except Exception as e:  # noqa: BLE001
                errors.append(f"{kind}: {e!r}")

    t = threading.Thread(target=attack)
    s.step += 1
    s._save(s.step)
    t.start()
    a = s._wait(s.step)
    t.join()
    rep = s.head.call("wait_replication")
    if not a["ok"]:
        raise Violation(f"a save failed while {victim}'s peer port got garbage: {a['message']}")
    if not rep["ok"]:
        raise Violation(f"replication failed while {victim}'s peer port got garbage: {rep['message']}")
    if not s.cluster.is_running(victim):
        raise Violation(f"{victim}'s daemon died from garbage on its peer port")


def _send_garbage(host: str, port: int, kind: str, r: random.Random) -> None:
    with socket.create_connection((host, port), timeout=5) as sock:
        if kind == "random":
            sock.sendall(r.randbytes(r.randint(1, 4096)))
        elif kind in ("wrong_token", "no_token"):
            args = {"blob": "0" * 32} if kind == "no_token" else {"blob": "0" * 32, "token": "x" * 64}
            protocol.send_request(sock, protocol.Request("get", 1, args))
            with contextlib.suppress(Exception):
                reply = protocol.recv_reply(sock)
                if reply.error is None:
                    raise Violation(f"the peer port served an unauthenticated {kind} request: {reply.result}")
        elif kind == "huge_length":
            sock.sendall((1 << 62).to_bytes(8, "big") + r.randbytes(64))
        elif kind == "half_header":
            sock.sendall(b"\x00\x00\x00\x10")
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            sock.settimeout(2)
            sock.recv(1 << 16)


def _cut_during_save(s: Soak, r: random.Random, d: dict, hosts: list[str]) -> None:
    """``hosts`` cut off from the network (their links down) for 0.5-4 s in the middle of a save, then healed."""
    delay = round(r.uniform(0, 1.0) * s.save_s, 3)
    cut_s = round(r.uniform(0.5, 4.0), 2)
    d.update(after_s=delay, cut_s=cut_s)
    s.step += 1
    a = s._save(s.step)
    time.sleep(delay)
    for h in hosts:
        s.net.cut(h)
    try:
        time.sleep(cut_s)
    finally:
        for h in hosts:
            s.net.heal(h)
    _saved_beside(s, a, d, hosts, "cut off")


def _saved_beside(s: Soak, a: dict, d: dict, hosts: list[str], what: str) -> None:
    """The end of a save a network fault ran beside: only the hosts it hit may have failed it."""
    if a["ok"]:
        a = s._wait(s.step)
    else:
        s.failed.add(s.step)
    d["save"] = "ok" if a["ok"] else "failed"
    if not a["ok"] and set(a["hosts"]) - set(hosts):
        raise Violation(f"the save failed on {a['hosts']}, but only {hosts} were {what}: {a['message']}")


def fault_net_cut(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    """One host cut off from the network (its link down) for a while, in the middle of a save."""
    victim = r.choice(s.live)
    d.update(host=victim)
    _cut_during_save(s, r, d, [victim])


def fault_net_slow(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    """One host's link capped to a few Mbit/s for a while (a slow or congested network), across a save
    and its replication: the save may be slow, never wrong; only that host may fail it."""
    victim = r.choice(s.live)
    mbit = r.choice([2, 8, 32])
    slow_s = round(r.uniform(1.0, 5.0), 2)
    d.update(host=victim, mbit=mbit, slow_s=slow_s)
    s.net.slow(victim, mbit)
    try:
        s.step += 1
        a = s._save(s.step)
        time.sleep(slow_s)
    finally:
        s.net.unslow(victim)
    _saved_beside(s, a, d, [victim], "slowed")


def fault_net_partition(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    """A partition: every host of one slice (half the hosts, with one slice) cut off from the head, the
    bucket and the other slice in the middle of a save, then healed; saves go on after it heals."""
    c = s.cluster
    if c.num_slices > 1:
        sl = r.randrange(c.num_slices)
        side = [h for h in s.live if h.startswith(f"s{sl}-")]
    else:
        side = sorted(s.live)[: max(1, len(s.live) // 2)]
    d.update(hosts=side)
    _cut_during_save(s, r, d, side)


def fault_net_loss(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    """Packet loss on one host's link (or on every host's, one time in four), both ways, for a while in the
    middle of a save: TCP retransmits; the save may be slow, never wrong; only those hosts may fail it."""
    hosts = list(s.live) if r.random() < 0.25 else [r.choice(s.live)]
    percent = r.choice([5, 15, 30])
    delay = round(r.uniform(0, 1.0) * s.save_s, 3)
    loss_s = round(r.uniform(1.0, 5.0), 2)
    d.update(hosts=hosts, percent=percent, after_s=delay, loss_s=loss_s)
    s.step += 1
    a = s._save(s.step)
    time.sleep(delay)
    try:
        for h in hosts:
            s.net.lose(h, percent)
        time.sleep(loss_s)
    finally:
        for h in hosts:
            s.net.unlose(h)
    _saved_beside(s, a, d, hosts, "losing packets")


def fault_net_latency(s: Soak, r: random.Random, cls: str, d: dict) -> None:
    """Added latency on one host's link (or on every host's, one time in four): each chunk into and out of
    it held ``ms`` each way, on open connections too, for a whole save and its replication; both must
    succeed (latency slows a save, it does not fail one), and nothing may be wrong."""
    hosts = list(s.live) if r.random() < 0.25 else [r.choice(s.live)]
    ms = r.choice([10, 50, 200])
    d.update(hosts=hosts, ms=ms)
    t0 = time.perf_counter()
    try:
        for h in hosts:
            s.net.delay(h, ms)
        s.step += 1
        a = s._save(s.step)
        if a["ok"]:
            a = s._wait(s.step)
        else:
            s.failed.add(s.step)
        rep = s.head.call("wait_replication") if a["ok"] else a
    finally:
        for h in hosts:
            s.net.delay(h, 0)
    d.update(save="ok" if a["ok"] else "failed", save_s=round(time.perf_counter() - t0, 2))
    if not a["ok"]:
        raise Violation(f"a save failed under {ms} ms of latency on {hosts}: {a['error']}: {a['message']}")
    if not rep["ok"]:
        raise Violation(f"replication failed under {ms} ms of latency on {hosts}: {rep['error']}: {rep['message']}")


FAULTS: dict[str, Callable] = {
    "kill_sidecar": fault_kill_sidecar, "crash": fault_crash, "kill_head": fault_kill_head,
    "wipe_host": fault_wipe_host, "wipe_slice": fault_wipe_slice, "wipe_all": fault_wipe_all,
    "flip_ram_blob": fault_flip_ram_blob, "flip_peer_copy": fault_flip_peer_copy,
    "flip_backup_blob": fault_flip_backup_blob, "flip_manifest": fault_flip_manifest,
    "gcs_outage": fault_gcs_outage, "gcs_outage_head_restart": fault_gcs_outage_head_restart,
    "ramdisk_full": fault_ramdisk_full, "slice_lost": fault_slice_lost, "garbage_peer": fault_garbage_peer,
    "net_cut": fault_net_cut, "net_slow": fault_net_slow, "net_partition": fault_net_partition,
    "net_loss": fault_net_loss, "net_latency": fault_net_latency,
}

HEADER = ["fault class", "injected", "injection failed", "survived", "restores checked", "wrong restores",
          "lost committed steps", "median recover s", "worst recover s"]


def format_table(rows: list[list[str]]) -> str:
    """The summary as a Markdown table (README) ..."""
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def print_rich_table(rows: list[list[str]], title: str) -> None:
    """... and as a rich table on the terminal."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows))
        return
    t = Table(title=title)
    for i, h in enumerate(HEADER):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    Console(width=180).print(t)  # the class names whole beside the 9 columns


def run_soak(seed: int, *, minutes: float | None = None, trials: int | None = None, trials_per_segment: int = 24,
             segments=SEGMENTS, out=print, only: list[str] | None = None, keep: bool = False) -> Soak:
    """Run one soak; raises Violation (after printing the schedule so far) at the first broken invariant."""
    workdir = Path(tempfile.mkdtemp(prefix="mtc-soak-"))
    soak = Soak(seed, workdir, trials_per_segment=trials_per_segment, segments=segments, out=out, only=only,
                keep=keep)
    deadline = time.monotonic() + minutes * 60 if minutes is not None else None
    out(f"soak seed {seed} (replay: python -m tests.chaos.soak --seed {seed}"
        f"{f' --minutes {minutes:g}' if minutes is not None else ''}{f' --trials {trials}' if trials else ''})")
    try:
        soak.run(deadline=deadline, max_trials=trials)
    except BaseException as e:
        out(f"FAILED (seed {seed}): {e}")
        out("schedule up to the failure:")
        for line in soak.schedule:
            out(f"  {line}")
        raise
    finally:
        soak._teardown_segment() if getattr(soak, "seg", None) and soak.seg.exists() else None
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        leftovers = [c for c in psutil.Process().children(recursive=True)
                     if c.status() != psutil.STATUS_ZOMBIE and c.pid not in soak.preexisting]
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if str(workdir) in line]
        namespaces = [n for n in leftover_netns() if n.split("-")[2] in {str(net.tag) for net in soak.networks}]
        for net in soak.networks:
            net.release()
        if leftovers or mounts or namespaces:
            raise Violation(f"left behind: processes {[c.pid for c in leftovers]}, mounts {mounts}, "
                            f"network namespaces {namespaces}")
    return soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="run for this long (default: one pass of segments)")
    p.add_argument("--trials", type=int, default=None, help="stop after this many trials")
    p.add_argument("--seed", type=int, default=None, help="replay this seed's schedule (default: a random seed)")
    p.add_argument("--trials-per-segment", type=int, default=24)
    p.add_argument("--markdown", default=None, help="also write the summary table (Markdown) to this file")
    p.add_argument("--only", action="append", choices=FAULT_CLASSES, help="draw only this class (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs) after the run")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    t0 = time.perf_counter()
    try:
        soak = run_soak(seed, minutes=a.minutes, trials=a.trials, trials_per_segment=a.trials_per_segment,
                        out=lambda m: print(m, flush=True), only=a.only, keep=a.keep)
    except Violation:
        return 1
    except CannotDraw as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = soak.summary_rows()
    took = time.perf_counter() - t0
    print_rich_table(rows, f"soak seed {seed}: {soak.trial} trials in {took / 60:.1f} min")
    if soak.bucket_lost:
        soak.notes["the emulator came back from a restart without its bucket (re-created)"] = soak.bucket_lost
    if soak.notes:
        print("notes: " + "; ".join(f"{k} ({v}x)" for k, v in sorted(soak.notes.items())))
    print(f"max per daemon: {soak.max_seen}")
    if a.markdown:
        Path(a.markdown).write_text(format_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
