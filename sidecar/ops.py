"""The table of sidecar operations: what each one calls, how its arguments are checked, what it may change.

Both transports serve control requests through ``serve``: the colocated wrapper
(``mtc.sidecar.colocated``) and the daemon (``mtc.sidecar.daemon``) only decode a request into
(op, args, payloads), call ``serve`` and encode what it returns. So an operation exists in both
modes with one meaning, and bad arguments get the same ``ProtocolError`` from either.

A request is ``args`` (a JSON object) and ``payloads`` (byte strings: manifests; the daemon sends
them as binary frames, the colocated transport as JSON text). An answer is (result, payloads)
the same way.

Two operations carry array data, which each transport moves its own way (``DATA_OPS``): ``write``
(jax.Arrays in colocated mode, one payload per shard to a daemon) and ``read`` (the colocated
``load`` builds jax.Arrays on the host's devices; the daemon sends raw bytes). Their headers are
checked here (``parse_write``, ``parse_read``) and they call the same service methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from mtc.shared import backup_layout
from mtc.shared import format as fmt
from mtc.shared.errors import ProtocolError
from mtc.sidecar.jobs import MAX_WAIT_S
from mtc.sidecar.replication import parse_peers, parse_pulls, parse_shares

Args = tuple[tuple, dict]  # the positional and keyword arguments of the service method


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: the ``SidecarService`` method it calls and how its request becomes the call."""

    method: str
    parse: Callable[[dict, Sequence[bytes]], Args]
    answer: Callable[[Any], tuple[Any, list]] = lambda result: (result, [])
    mutating: bool = False  # changes the host: only the head holding the lease may send it (fencing)
    long: bool = False  # runs as a job of the sidecar: answers {"job": id} at once, ``job`` tells its end
    modes: tuple[str, ...] = ("colocated", "cluster")
    why: str = ""  # why an operation is not in both modes


# --- argument checks (shared by both transports) ---------------------------------------------


def step_arg(args: dict) -> int:
    step = args.get("step")
    if type(step) is not int or step < 0:
        raise ProtocolError(f"'step' must be an integer >= 0, got {step!r:.50}")
    return step


def box_arg(value: Any, where: str) -> fmt.Box:
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p) and 0 <= p[0] <= p[1]
            for p in value):
        raise ProtocolError(f"{where}: box {value!r:.100} is not a list of [start, stop] pairs")
    return tuple((p[0], p[1]) for p in value)


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{where}: 'blobs' must be a list of blob names")
    return value


def _name(args: dict, where: str) -> str:
    name = args.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where} needs 'name' (the backup's name)")
    return name


def _payloads(payloads: Sequence[bytes], where: str, *, at_most: int = 1, exactly: int | None = None) -> list[bytes]:
    n = len(payloads)
    if (exactly is not None and n != exactly) or n > at_most:
        want = f"exactly {exactly}" if exactly is not None else f"at most {at_most}"
        raise ProtocolError(f"{where}: {want} payload(s) expected, got {n}")
    return [bytes(p) for p in payloads]


def _none(args: dict, payloads: Sequence[bytes]) -> Args:
    return (), {}


def _step_only(args: dict, payloads: Sequence[bytes]) -> Args:
    return (step_arg(args),), {}


def _inventory(args: dict, payloads: Sequence[bytes]) -> Args:
    devices = args.get("devices")
    if devices is not None and (not isinstance(devices, list) or not all(type(d) is int for d in devices)):
        raise ProtocolError("inventory: 'devices' must be a list of device ids")
    return (devices,), {}


def _manifest(args: dict, payloads: Sequence[bytes]) -> Args:
    here_only = args.get("here_only", False)
    if not isinstance(here_only, bool):
        raise ProtocolError("manifest: 'here_only' must be true or false")
    return (step_arg(args),), {"here_only": here_only}


def _commit(args: dict, payloads: Sequence[bytes]) -> Args:
    step = step_arg(args)
    (manifest,) = _payloads(payloads, "commit (the step manifest, for a keeper)") or [None]
    digest, keepers = args.get("digest"), args.get("keepers")
    if digest is not None and not isinstance(digest, str):
        raise ProtocolError("commit: 'digest' is not a string")
    if keepers is not None and not (isinstance(keepers, list) and all(
            isinstance(k, list) and len(k) == 2 and all(isinstance(x, str) for x in k) for k in keepers)):
        raise ProtocolError("commit: 'keepers' is not a list of [host, peer address]")
    return (step, manifest), {"digest": digest, "keepers": [tuple(k) for k in keepers] if keepers else None}


def _claim(args: dict, payloads: Sequence[bytes]) -> Args:
    head = args.get("head")
    if not isinstance(head, dict):
        raise ProtocolError("claim needs 'head' (an object naming the head)")
    return (args.get("generation"), head), {}


def _configure(args: dict, payloads: Sequence[bytes]) -> Args:
    settings = args.get("settings")
    if not isinstance(settings, dict):
        raise ProtocolError("configure needs 'settings' (an object of the head's settings)")
    return (settings,), {"generation": args.get("gen")}


def _job(args: dict, payloads: Sequence[bytes]) -> Args:
    job_id, wait_s = args.get("job"), args.get("wait_s", 0.0)
    if not isinstance(job_id, str) or not job_id.isalnum() or len(job_id) > 64:
        raise ProtocolError("job needs 'job': the id a long operation answered with")
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_S:
        raise ProtocolError(f"'wait_s' must be a number in [0, {MAX_WAIT_S:g}]")
    return (job_id, float(wait_s)), {}


def _backup_upload(args: dict, payloads: Sequence[bytes]) -> Args:
    return (_names(args.get("blobs"), "backup_upload"),), {}


def _backup_finalize(args: dict, payloads: Sequence[bytes]) -> Args:
    name = _name(args, "backup_finalize")
    (manifest,) = _payloads(payloads, "backup_finalize (the step manifest)", exactly=1)
    return (name, manifest), {"generation": args.get("gen")}


def _root(args: dict, where: str) -> str | None:
    root = args.get("root")
    if root is not None and (not isinstance(root, str) or not root):
        raise ProtocolError(f"{where}: 'root' must be the backup root (a non-empty string) or null")
    return root


def _backup_listing(args: dict, payloads: Sequence[bytes]) -> Args:
    deadline = args.get("deadline_s")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline < 0):
        raise ProtocolError("'deadline_s' must be a number >= 0 or null")
    return (_root(args, "backup_listing"), deadline), {}


def _backup_manifest(args: dict, payloads: Sequence[bytes]) -> Args:
    return (_root(args, "backup_manifest"), _name(args, "backup_manifest")), {}


def _backup_fetch(args: dict, payloads: Sequence[bytes]) -> Args:
    return (_name(args, "backup_fetch"), _names(args.get("blobs"), "backup_fetch")), {}


def _backup_scrub(args: dict, payloads: Sequence[bytes]) -> Args:
    rate, damaged = args.get("bytes_per_s"), args.get("damaged", {})
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
        raise ProtocolError(f"backup_scrub: 'bytes_per_s' must be a number > 0 (the bandwidth cap) or null, "
                            f"got {rate!r:.50}")
    if not isinstance(damaged, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in damaged.items()):
        raise ProtocolError("backup_scrub: 'damaged' must be an object of backup name -> why")
    sizes, clear = args.get("sizes", {}), args.get("clear", [])
    if not isinstance(sizes, dict) or not all(isinstance(k, str) and type(v) is int and 0 <= v < 2**63
                                              for k, v in sizes.items()):
        raise ProtocolError("backup_scrub: 'sizes' must be an object of blob name -> its size in bytes")
    if not isinstance(clear, list) or not all(backup_layout.is_backup_name(n) for n in clear):
        raise ProtocolError("backup_scrub: 'clear' must be a list of backup names")
    return (_root(args, "backup_scrub"), _names(args.get("blobs", []), "backup_scrub"),
            _names(args.get("repair", []), "backup_scrub (repair)"), damaged, rate), {
        "ramdisk": _names(args.get("ramdisk", []), "backup_scrub (ramdisk)"), "sizes": sizes, "clear": clear}


def _peer_pull(args: dict, payloads: Sequence[bytes]) -> Args:
    step = step_arg(args)
    (manifest,) = _payloads(payloads, "peer_pull (the step manifest, to adopt the step)") or [None]
    return (step, parse_pulls(args.get("pulls", [])), parse_peers(args.get("peers")), manifest,
            parse_shares(args.get("shares"))), {}


def parse_write(args: dict, count: int) -> tuple[int, int, list[tuple[int, fmt.Box]] | None]:
    """A ``write``'s header: (step, part, [(array index, box)] when the request lists its shards)."""
    step = step_arg(args)
    part = args.get("part", 0)
    if type(part) is not int or part < 0:
        raise ProtocolError(f"write: 'part' must be an integer >= 0, got {part!r:.50}")
    rows = args.get("shards")
    if rows is None:
        return step, part, None
    if not isinstance(rows, list) or len(rows) != count:
        raise ProtocolError(f"write: 'shards' must list one [array, box] per payload ({count} payloads)")
    out = []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and row[0] >= 0):
            raise ProtocolError(f"write: shards[{i}] is not [array index, box]")
        out.append((row[0], box_arg(row[1], f"write: shards[{i}]")))
    return step, part, out


def parse_read(args: dict) -> tuple[int, list[tuple[str, fmt.Box | None]], str | None, list[int]]:
    """A ``read``'s header: (step, [(key, box or None)], manifest digest or None, indices to stream)."""
    step = step_arg(args)
    reads = args.get("reads")
    if not isinstance(reads, list):
        raise ProtocolError("read: 'reads' must be a list of [key, box or null]")
    boxes = []
    for i, row in enumerate(reads):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
            raise ProtocolError(f"read: reads[{i}] is not [key, box or null]")
        boxes.append((row[0], None if row[1] is None else box_arg(row[1], f"read: reads[{i}]")))
    manifest = args.get("manifest")
    if manifest is not None and not isinstance(manifest, str):
        raise ProtocolError("read: 'manifest' must be the step manifest's digest (a string) or null")
    stream = args.get("stream", [])
    if not isinstance(stream, list) or not all(type(i) is int and 0 <= i < len(boxes) for i in stream):
        raise ProtocolError("read: 'stream' must list indices into 'reads' (the boxes the head hashes itself)")
    return step, boxes, manifest, stream


def _bytes_answer(data: bytes) -> tuple[Any, list]:
    return {}, [bytes(data)]


# Every control operation. The data operations (``DATA_OPS``) are served by each transport itself.
OPS: dict[str, Op] = {
    "ping": Op("ping", _none),
    "fingerprint": Op("fingerprint", _none),
    "inventory": Op("inventory", _inventory),
    "manifest": Op("manifest_bytes", _manifest, answer=_bytes_answer),
    "part": Op("part_bytes", _step_only, answer=_bytes_answer),
    "commit": Op("commit", _commit, mutating=True),
    "abort": Op("abort", _step_only, answer=lambda removed: ({"removed": removed}, []), mutating=True),
    "verify": Op("verify", _step_only),
    "lease": Op("current_lease", _none, answer=lambda lease: ({"lease": lease}, [])),
    "claim": Op("claim", _claim),  # generation-checked by the lease itself (a newer head takes over)
    "configure": Op("configure", _configure, mutating=True),
    "job": Op("job", _job),
    "backup_upload": Op("backup_upload", _backup_upload, mutating=True, long=True),
    "backup_finalize": Op("backup_finalize", _backup_finalize, mutating=True),
    "backup_listing": Op("backup_listing", _backup_listing),
    "backup_manifest": Op("backup_manifest", _backup_manifest, answer=_bytes_answer),
    "backup_fetch": Op("backup_fetch", _backup_fetch, mutating=True, long=True),
    "peer_pull": Op("peer_pull", _peer_pull, mutating=True, long=True),
    # Not fenced: it writes only bytes that hash to the object's name, and marks only backups it found
    # bad, so `mtc verify --backup` may run it beside the head that drives the hosts.
    "backup_scrub": Op("backup_scrub", _backup_scrub, long=True),
    "close": Op("close", _none, answer=lambda _: (True, []), modes=("colocated",),
                why="a daemon's service lives as long as its process: SIGTERM stops it"),
}

# The operations that carry arrays, with the service method each calls (see the module's text).
DATA_OPS = {"write": "write_shards", "read": "read_boxes_each"}

MUTATING_OPS = frozenset({name for name, op in OPS.items() if op.mutating} | {"write"})
LONG_OPS = frozenset(name for name, op in OPS.items() if op.long)
SERVICE_METHODS = {**{name: op.method for name, op in OPS.items()}, **DATA_OPS}


def check(name: str, mode: str) -> Op:
    """The operation ``name`` as served in ``mode`` ("colocated" or "cluster"), or ProtocolError."""
    op = OPS.get(name)
    if op is None:
        known = sorted({n for n, o in OPS.items() if mode in o.modes} | set(DATA_OPS))
        raise ProtocolError(f"unknown op {name!r}; known ops: {', '.join(known)}")
    if mode not in op.modes:
        raise ProtocolError(f"operation {name!r} is not served in {mode} mode: {op.why}")
    return op


def serve(service: Any, name: str, args: dict, payloads: Sequence[bytes], mode: str) -> tuple[Any, list]:
    """Serve one control request on ``service``: (result, payloads). Raises what the call raised."""
    op = check(name, mode)
    service.admit(name, args.get("gen"))
    call_args, call_kwargs = op.parse(args, payloads)
    method = getattr(service, op.method)
    if op.long:
        return {"job": service.start_job(lambda: method(*call_args, **call_kwargs))}, []
    return op.answer(method(*call_args, **call_kwargs))

