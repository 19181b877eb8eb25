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
import json
from typing import Any, Callable, Sequence

from mtc.shared import backup_layout
from mtc.shared import format as fmt
from mtc.shared.errors import ManifestError, ProtocolError
from mtc.shared.hashing import is_blob_name
from mtc.sidecar.jobs import MAX_WAIT_S
from mtc.sidecar.ram.common import MAX_STEP
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
#
# Every number and string an operation accepts is bounded here, so that nothing the service does
# with it (a file name, a path, a metric) can fail on its size or content: a request out of bounds
# is a ProtocolError naming the argument, and it changes nothing.

MAX_GENERATION = 2**63 - 1  # a head's generation (microseconds since the epoch, or one more than the lease's)
MAX_INDEX = 2**31 - 1  # a device id, an array index, a part number
MAX_DEADLINE_S = 24 * 3600.0  # how long a listing may retry an unreachable store
MAX_ROOT_CHARS = 4096  # a backup root (PATH_MAX)
MAX_NAME_CHARS = 255  # a backup name (NAME_MAX)
MAX_HEAD_CHARS = 4096  # a claiming head's description, as JSON (kept in the lease file)
MAX_SETTING = 2**53  # a count or rate of the head's settings (exact as a metric's float)
_URL_SCHEMES = ("gs://", "file:///")


def step_arg(args: dict) -> int:
    step = args.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ProtocolError(f"'step' must be an integer in [0, {MAX_STEP}], got {step!r:.50}")
    return step


def gen_arg(args: dict, key: str = "gen", *, where: str = "the request") -> int | None:
    """The head's generation in ``args[key]`` (None when absent), bounded."""
    gen = args.get(key)
    if gen is not None and (type(gen) is not int or not 1 <= gen <= MAX_GENERATION):
        raise ProtocolError(f"{where}: '{key}' must be the head's generation, an integer in [1, 2**63 - 1], "
                            f"got {gen!r:.50}")
    return gen


def _index(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INDEX


def box_arg(value: Any, where: str) -> fmt.Box:
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p) and 0 <= p[0] <= p[1] < 2**63
            for p in value):
        raise ProtocolError(f"{where}: box {value!r:.100} is not a list of [start, stop] pairs (0 <= start <= stop "
                            "< 2**63)")
    return tuple((p[0], p[1]) for p in value)


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(is_blob_name(v) for v in value):
        bad = next((v for v in value if not is_blob_name(v)), None) if isinstance(value, list) else value
        raise ProtocolError(f"{where}: 'blobs' must be a list of blob names (32 lowercase hex digits), "
                            f"got {bad!r:.80}")
    return value


def _text(value: Any, where: str, what: str, max_chars: int) -> str:
    """A non-empty string of at most ``max_chars`` characters without NUL, or ProtocolError."""
    if not isinstance(value, str) or not value or len(value) > max_chars or "\0" in value:
        raise ProtocolError(f"{where}: {what} must be a non-empty string of at most {max_chars} characters "
                            f"without NUL, got {value!r:.80}")
    return value


def _name(args: dict, where: str) -> str:
    return _text(args.get("name"), where, "'name' (the backup's name)", MAX_NAME_CHARS)


def root_arg(root: Any, where: str, what: str = "'root'") -> str:
    """A backup root as a request names it: an absolute path, ``file:///...`` or ``gs://...``.

    A relative path is refused: it would name a folder under this process's working directory,
    not the head's backup root (the head sends its root absolute)."""
    _text(root, where, what, MAX_ROOT_CHARS)
    if not (root.startswith("/") or root.lower().startswith(_URL_SCHEMES)):
        raise ProtocolError(f"{where}: {what} {root!r:.80} is not absolute; give the backup root as an absolute "
                            "path, file:///path or gs://bucket/prefix")
    return root


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
    if devices is not None and (not isinstance(devices, list) or not all(_index(d) for d in devices)):
        raise ProtocolError(f"inventory: 'devices' must be a list of device ids (integers in [0, {MAX_INDEX}])")
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
    if digest is not None and (not isinstance(digest, str) or len(digest) > 128):
        raise ProtocolError("commit: 'digest' is not a digest (a string of at most 128 characters)")
    if keepers is not None and not (isinstance(keepers, list) and all(
            isinstance(k, list) and len(k) == 2 and all(isinstance(x, str) and len(x) <= 255 and "\0" not in x
                                                        for x in k) for k in keepers)):
        raise ProtocolError("commit: 'keepers' is not a list of [host, peer address]")
    return (step, manifest), {"digest": digest, "keepers": [tuple(k) for k in keepers] if keepers else None}


def _claim(args: dict, payloads: Sequence[bytes]) -> Args:
    head = args.get("head")
    if not isinstance(head, dict) or len(json.dumps(head)) > MAX_HEAD_CHARS:
        raise ProtocolError(f"claim needs 'head' (an object naming the head, at most {MAX_HEAD_CHARS} characters "
                            "as JSON)")
    generation = gen_arg(args, "generation", where="claim")
    if generation is None:
        raise ProtocolError("claim needs 'generation' (the head's generation)")
    return (generation, head), {}


def _configure(args: dict, payloads: Sequence[bytes]) -> Args:
    settings = args.get("settings")
    if not isinstance(settings, dict):
        raise ProtocolError("configure needs 'settings' (an object of the head's settings)")
    for key in ("local_max_to_keep", "backup_max_to_keep", "backup_scrub_bytes_per_s"):
        v = settings.get(key, 1)
        if type(v) is int and v > MAX_SETTING:
            raise ProtocolError(f"configure: {key} must be at most {MAX_SETTING}, got {v!r:.50}")
    if settings.get("backup_url") is not None:
        root_arg(settings["backup_url"], "configure", "backup_url")
    return (settings,), {"generation": gen_arg(args, where="configure")}


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
    return (name, manifest), {"generation": gen_arg(args, where="backup_finalize")}


def _root(args: dict, where: str) -> str | None:
    root = args.get("root")
    return None if root is None else root_arg(root, where)


def _backup_listing(args: dict, payloads: Sequence[bytes]) -> Args:
    deadline = args.get("deadline_s")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not 0 <= deadline <= MAX_DEADLINE_S):
        raise ProtocolError(f"'deadline_s' must be a number in [0, {MAX_DEADLINE_S:g}] or null, got {deadline!r:.50}")
    return (_root(args, "backup_listing"), deadline), {}


def _backup_manifest(args: dict, payloads: Sequence[bytes]) -> Args:
    return (_root(args, "backup_manifest"), _name(args, "backup_manifest")), {}


def _backup_fetch(args: dict, payloads: Sequence[bytes]) -> Args:
    return (_name(args, "backup_fetch"), _names(args.get("blobs"), "backup_fetch")), {}


def _backup_scrub(args: dict, payloads: Sequence[bytes]) -> Args:
    rate, damaged = args.get("bytes_per_s"), args.get("damaged", {})
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not 0 < rate <= MAX_SETTING):
        raise ProtocolError(f"backup_scrub: 'bytes_per_s' must be a number > 0 (the bandwidth cap) or null, "
                            f"got {rate!r:.50}")
    if not isinstance(damaged, dict) or not all(backup_layout.is_backup_name(k) and isinstance(v, str)
                                                and len(v) <= 4096 for k, v in damaged.items()):
        raise ProtocolError("backup_scrub: 'damaged' must be an object of backup name -> why (at most 4096 "
                            "characters)")
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
    if not _index(part):
        raise ProtocolError(f"write: 'part' must be an integer in [0, {MAX_INDEX}], got {part!r:.50}")
    rows = args.get("shards")
    if rows is None:
        return step, part, None
    if not isinstance(rows, list) or len(rows) != count:
        raise ProtocolError(f"write: 'shards' must list one [array, box] per payload ({count} payloads)")
    out = []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 2 and _index(row[0])):
            raise ProtocolError(f"write: shards[{i}] is not [array index, box]")
        out.append((row[0], box_arg(row[1], f"write: shards[{i}]")))
    return step, part, out


def _manifest_digest(args: dict, op: str) -> str | None:
    manifest = args.get("manifest")
    if manifest is not None and (not isinstance(manifest, str) or len(manifest) > 128):
        raise ProtocolError(f"{op}: 'manifest' must be the step manifest's digest (a string of at most 128 "
                            "characters) or null")
    return manifest


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
    manifest = _manifest_digest(args, "read")
    stream = args.get("stream", [])
    if not isinstance(stream, list) or not all(type(i) is int and 0 <= i < len(boxes) for i in stream):
        raise ProtocolError("read: 'stream' must list indices into 'reads' (the boxes the head hashes itself)")
    return step, boxes, manifest, stream


def parse_load(args: dict) -> tuple[int, list[dict], str | None]:
    """A colocated ``load``'s header: (step, the arrays to build, manifest digest or None).

    Each array is ``{"key", "shape", "dtype", "sharding", "as_bytes"?}``: its shape and dtype are
    checked here (the dtype returned as a ``numpy.dtype``); its sharding where it is rebuilt on
    this host's devices."""
    step = step_arg(args)
    arrays = args.get("arrays")
    if not isinstance(arrays, list):
        raise ProtocolError("load: 'arrays' must be a list of {key, shape, dtype, sharding}")
    out = []
    for i, spec in enumerate(arrays):
        where = f"load: arrays[{i}]"
        if not (isinstance(spec, dict) and isinstance(spec.get("key"), str)):
            raise ProtocolError(f"{where} is not an object with a 'key' (text)")
        shape = spec.get("shape")
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(type(n) is int and 0 <= n <= MAX_SETTING for n in shape)):
            raise ProtocolError(f"{where}: 'shape' must be a list of at most 64 sizes (integers >= 0)")
        if not isinstance(spec.get("dtype"), str):
            raise ProtocolError(f"{where}: 'dtype' must be a dtype's name")
        try:
            dtype = fmt.dtype_from_name(spec["dtype"])
        except (ManifestError, TypeError, ValueError) as e:
            raise ProtocolError(f"{where}: {e}") from None
        if not isinstance(spec.get("sharding"), dict):
            raise ProtocolError(f"{where}: 'sharding' must be an object (a sharding's description)")
        as_bytes = spec.get("as_bytes", False)
        if type(as_bytes) is not bool:
            raise ProtocolError(f"{where}: 'as_bytes' must be true or false")
        out.append({"key": spec["key"], "shape": tuple(shape), "dtype": dtype, "sharding": spec["sharding"],
                    "as_bytes": as_bytes})
    manifest = _manifest_digest(args, "load")
    return step, out, manifest


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
    service.admit(name, gen_arg(args))
    call_args, call_kwargs = op.parse(args, payloads)
    method = getattr(service, op.method)
    if op.long:
        return {"job": service.jobs.start(lambda: method(*call_args, **call_kwargs))}, []
    return op.answer(method(*call_args, **call_kwargs))

