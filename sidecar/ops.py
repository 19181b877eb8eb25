"""The table of sidecar operations: what each one calls, how its arguments are checked, what it may change.

Each operation's row of plain facts (fencing, job, data, modes, lane, timeout class) is
``mtc.shared.op_table``, which the head reads too; ``OPS`` here attaches to each what it calls
on the ``SidecarService`` (a method of the service or of the part that owns the state:
``method_of``) and its parser, and refuses to load if the two tables name different
operations.

Both transports serve control requests through ``serve``: the colocated wrapper
(``mtc.sidecar.colocated``) and the daemon (``mtc.sidecar.daemon``) only decode a request into
(op, args, payloads), call ``serve`` and encode what it returns. So an operation exists in both
modes with one meaning, and bad arguments get the same ``ProtocolError`` from either.

A request is ``args`` (a JSON object) and ``payloads`` (byte strings: manifests; the daemon sends
them as binary frames, the colocated transport as JSON text). An answer is (result, payloads)
the same way.

Two operations carry arrays (``Op.spec.data``), which each transport moves its own way: ``write``
(jax.Arrays in colocated mode, one payload per shard to a daemon) and ``read`` (the colocated
``load`` builds jax.Arrays on the host's devices; the daemon sends raw bytes). ``serve`` refuses
them (a ``ProtocolError`` that names the data path); a transport's data path calls ``data_header``
first, which checks the operation, fences it and parses its header with the row's parser, before
anything is read or written. ``write`` has one header in both modes (``parse_write``): the arrays,
each ``{"index", "shape", "as_bytes"?}``, and in cluster mode ``shards``, one [array, box] per
payload (in colocated mode each array's shards are its own). ``read`` is ``parse_read`` (the boxes
a daemon sends) and, in colocated mode, ``parse_load`` (the arrays to build).
"""

from __future__ import annotations

import dataclasses
import operator
import json
from typing import Any, Callable, Sequence

from mtc.shared import backup_layout, op_table, shardings
from mtc.shared import format as fmt
from mtc.shared.errors import ManifestError, ProtocolError
from mtc.shared.hashing import is_blob_name
from mtc.sidecar.jobs import MAX_WAIT_S
from mtc.sidecar.ram.common import MAX_STEP
from mtc.sidecar.replication import parse_peers, parse_pulls, parse_shares

Args = tuple[tuple, dict]  # the positional and keyword arguments of the service method


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: what it calls on the ``SidecarService``, how its request becomes the call, and
    its row of ``mtc.shared.op_table`` (fencing, job, data, modes, lane, timeout class).

    ``method`` is the service's own method, or ``part.method`` of the part that owns the state
    the operation reads or changes (``saves``: the ``SaveWriter``; ``committed``: the
    ``CommittedSteps``; ``lease``; ``jobs``), so that the service holds no method that only
    forwards (``method_of``).

    A control operation's ``parse`` is (args, payloads) -> the method's arguments; a data
    operation's is (args, carried, mode) -> its header, ``carried`` the number of payloads (cluster)
    or array arguments (colocated) the request came with; ``parse_colocated``, where the colocated
    header differs (``read``: ``load`` names the arrays to build)."""

    method: str
    parse: Callable[..., Any]
    answer: Callable[[Any], tuple[Any, list]] = lambda result: (result, [])
    parse_colocated: Callable[..., Any] | None = None
    spec: op_table.OpSpec = op_table.OpSpec()

    def parser(self, mode: str) -> Callable[..., Any]:
        return self.parse_colocated if mode == "colocated" and self.parse_colocated is not None else self.parse


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
    header_only = args.get("header_only", False)
    if not isinstance(header_only, bool):
        raise ProtocolError("manifest: 'header_only' must be true or false")
    return (step_arg(args),), {"here_only": here_only, "header_only": header_only}


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
    if "step" in args:  # this host's designated share of the step's boxes, instead of a list of blobs
        if "blobs" in args:
            raise ProtocolError("backup_upload: give 'blobs' or 'step', not both")
        return (None,), {"step": step_arg(args)}
    return (_names(args.get("blobs"), "backup_upload"),), {}


def _backup_finalize(args: dict, payloads: Sequence[bytes]) -> Args:
    name = _name(args, "backup_finalize")
    if not payloads and "step" in args:  # from this host's own copy of the manifest, checked by its digest
        digest = args.get("digest")
        if not isinstance(digest, str) or not 0 < len(digest) <= 128:
            raise ProtocolError("backup_finalize: 'digest' must be the manifest's digest (at most 128 characters)")
        return (name, None), {"generation": gen_arg(args, where="backup_finalize"), "step": step_arg(args),
                              "digest": digest}
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
    adopt = args.get("adopt")
    if adopt is not None:
        if not (isinstance(adopt, dict) and isinstance(adopt.get("digest"), str) and 0 < len(adopt["digest"]) <= 128
                and isinstance(adopt.get("keepers"), list) and len(adopt["keepers"]) <= 64
                and all(isinstance(h, str) and 0 < len(h) <= 256 for h in adopt["keepers"])):
            raise ProtocolError("peer_pull: 'adopt' must be {digest: the manifest's digest, keepers: [host ids]}")
        adopt = (adopt["digest"], list(adopt["keepers"]))
    return (step, parse_pulls(args.get("pulls", [])), parse_peers(args.get("peers")), manifest,
            parse_shares(args.get("shares"))), {"adopt": adopt}


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not (isinstance(value, list) and len(value) <= 64 and all(type(n) is int and 0 <= n <= MAX_SETTING
                                                                  for n in value)):
        raise ProtocolError(f"{where}: 'shape' must be a list of at most 64 sizes (integers in [0, 2**53]), "
                            f"got {value!r:.80}")
    return tuple(value)


def _flag(spec: dict, key: str, where: str) -> bool:
    value = spec.get(key, False)
    if type(value) is not bool:
        raise ProtocolError(f"{where}: '{key}' must be true or false, got {value!r:.50}")
    return value


@dataclasses.dataclass(frozen=True)
class WriteArray:
    """One array of a ``write``: the leaf's index in the state and its shape, which every box of
    its shards lies in; ``as_bytes``: it travels as its flat bytes (a host numpy leaf), so its one
    box is its whole shape."""

    index: int
    shape: tuple[int, ...]
    as_bytes: bool = False


@dataclasses.dataclass(frozen=True)
class WriteHeader:
    """A ``write``'s header, checked (``parse_write``). ``shards``: in cluster mode, (position in
    ``arrays``, box) per payload; None in colocated mode, where each array's shards are its own."""

    step: int
    part: int
    arrays: tuple[WriteArray, ...]
    shards: tuple[tuple[int, fmt.Box], ...] | None

    def check_arrays(self, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> None:
        """The colocated transport's array arguments, as (shape, dtype) each, against ``arrays``:
        an array of another shape than its row's, or one ``as_bytes`` that is not flat uint8
        bytes, is a ProtocolError naming the row."""
        import numpy as np

        for i, ((shape, dtype), spec) in enumerate(zip(shapes, self.arrays)):
            if spec.as_bytes:
                if len(shape) != 1 or np.dtype(dtype) != np.uint8:
                    raise ProtocolError(f"write: arrays[{i}] is 'as_bytes' but the array sent is not flat bytes "
                                        f"(shape {list(shape)}, dtype {np.dtype(dtype).name}); send the leaf's "
                                        "bytes as a 1-D uint8 array, or leave 'as_bytes' out")
            elif tuple(shape) != spec.shape:
                raise ProtocolError(f"write: arrays[{i}]: 'shape' {list(spec.shape)} is not the shape of the array "
                                    f"sent ({list(shape)}); give each array's own shape")


def parse_write(args: dict, carried: int, mode: str) -> WriteHeader:
    """A ``write``'s header: ``{"step", "part", "arrays": [{"index", "shape", "as_bytes"?}]}`` and,
    in cluster mode, ``"shards"``: one [position in "arrays", box] per payload. ``carried``: the
    payloads (cluster) or array arguments (colocated) the request came with."""
    step = step_arg(args)
    part = args.get("part", 0)
    if not _index(part):
        raise ProtocolError(f"write: 'part' must be an integer in [0, {MAX_INDEX}], got {part!r:.50}")
    rows = args.get("arrays")
    if not isinstance(rows, list):
        raise ProtocolError(f"write: 'arrays' must be a list of {{index, shape, as_bytes?}}, got {rows!r:.50}")
    arrays, seen = [], set()
    for i, row in enumerate(rows):
        where = f"write: arrays[{i}]"
        if not (isinstance(row, dict) and _index(row.get("index"))):
            raise ProtocolError(f"{where}: 'index' must be the leaf's index, an integer in [0, {MAX_INDEX}], got "
                                f"{(row.get('index') if isinstance(row, dict) else row)!r:.50}")
        if row["index"] in seen:
            raise ProtocolError(f"{where}: 'index' {row['index']} is listed twice; list each array once")
        seen.add(row["index"])
        arrays.append(WriteArray(row["index"], _shape(row.get("shape"), where), _flag(row, "as_bytes", where)))
    shards = args.get("shards")
    if mode == "colocated":
        if len(arrays) != carried:
            raise ProtocolError(f"write: 'arrays' must list one row per array sent ({carried} arrays), "
                                f"got {len(arrays)}")
        if shards is not None:
            raise ProtocolError("write: 'shards' is not sent in colocated mode: each array's shards are its own")
        return WriteHeader(step, part, tuple(arrays), None)
    if not isinstance(shards, list) or len(shards) != carried:
        raise ProtocolError(f"write: 'shards' must list one [array, box] per payload ({carried} payloads), "
                            f"got {shards!r:.50}")
    out = []
    for i, row in enumerate(shards):
        where = f"write: shards[{i}]"
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and 0 <= row[0] < len(arrays)):
            raise ProtocolError(f"{where} is not [array, box] with array a position in 'arrays' (which has "
                                f"{len(arrays)} rows), got {row!r:.80}")
        spec, box = arrays[row[0]], box_arg(row[1], where)
        if len(box) != len(spec.shape) or any(stop > n for (_, stop), n in zip(box, spec.shape)):
            raise ProtocolError(f"{where}: box {fmt.box_str(box)} does not lie in the array's 'shape' "
                                f"{list(spec.shape)}")
        if spec.as_bytes and box != tuple((0, n) for n in spec.shape):
            raise ProtocolError(f"{where}: array {spec.index} is 'as_bytes': its one box is its whole 'shape' "
                                f"{list(spec.shape)}, got {fmt.box_str(box)}")
        out.append((row[0], box))
    return WriteHeader(step, part, tuple(arrays), tuple(out))


def _manifest_digest(args: dict, op: str) -> str | None:
    manifest = args.get("manifest")
    if manifest is not None and (not isinstance(manifest, str) or len(manifest) > 128):
        raise ProtocolError(f"{op}: 'manifest' must be the step manifest's digest (a string of at most 128 "
                            "characters) or null")
    return manifest


def _no_payloads(op: str, carried: int) -> None:
    if carried:
        raise ProtocolError(f"{op}: the request carries no payloads, got {carried}")


def keepers_arg(args: dict, where: str) -> dict[str, str]:
    """``keepers``: host -> the peer address it serves at now, for the hosts that keep the step's whole
    manifest (a host that committed a record fetches the header from them; its record has the addresses
    they had when the step was saved)."""
    keepers = args.get("keepers", {})
    if not (isinstance(keepers, dict) and len(keepers) <= 64 and all(
            isinstance(h, str) and isinstance(a, str) and 0 < len(h) <= 256 and 0 < len(a) <= 256
            for h, a in keepers.items())):
        raise ProtocolError(f"{where}: 'keepers' must map at most 64 host ids to peer addresses")
    return keepers


def parse_read(args: dict, carried: int = 0, mode: str = "cluster"
               ) -> tuple[int, list[tuple[str, fmt.Box | None]], str | None, list[int], dict[str, str]]:
    """A ``read``'s header: (step, [(key, box or None)], manifest digest or None, indices to stream,
    keepers' addresses)."""
    _no_payloads("read", carried)
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
    return step, boxes, manifest, stream, keepers_arg(args, "read")


def parse_load(args: dict, carried: int = 0, mode: str = "colocated"
               ) -> tuple[int, list[dict], str | None, dict[str, str]]:
    """A colocated ``load``'s header: (step, the arrays to build, manifest digest or None, keepers'
    addresses: ``keepers_arg``).

    Each array is ``{"key", "shape", "dtype", "sharding", "as_bytes"?}``: its shape and dtype are
    checked here (the dtype returned as a ``numpy.dtype``); its sharding, an index into the request's
    ``"shardings"`` (each description sent once: a mesh lists every device), where it is rebuilt on
    this host's devices. Arrays of one sharding get the same description object."""
    _no_payloads("load", carried)
    step = step_arg(args)
    arrays, table = args.get("arrays"), args.get("shardings")
    if not isinstance(arrays, list):
        raise ProtocolError("load: 'arrays' must be a list of {key, shape, dtype, sharding}")
    if not (isinstance(table, list) and all(isinstance(d, dict) for d in table)):
        raise ProtocolError("load: 'shardings' must be a list of sharding descriptions")
    try:
        table = [shardings.unpack(d, f"load: shardings[{i}]") for i, d in enumerate(table)]
    except ManifestError as e:
        raise ProtocolError(str(e)) from None
    out = []
    for i, spec in enumerate(arrays):
        where = f"load: arrays[{i}]"
        if not (isinstance(spec, dict) and isinstance(spec.get("key"), str)):
            raise ProtocolError(f"{where} is not an object with a 'key' (text)")
        shape = _shape(spec.get("shape"), where)
        if not isinstance(spec.get("dtype"), str):
            raise ProtocolError(f"{where}: 'dtype' must be a dtype's name")
        try:
            dtype = fmt.dtype_from_name(spec["dtype"])
        except (ManifestError, TypeError, ValueError) as e:
            raise ProtocolError(f"{where}: {e}") from None
        idx = spec.get("sharding")
        if type(idx) is not int or not 0 <= idx < len(table):
            raise ProtocolError(f"{where}: 'sharding' must be an index into 'shardings' (0 to {len(table) - 1})")
        as_bytes = _flag(spec, "as_bytes", where)
        out.append({"key": spec["key"], "shape": shape, "dtype": dtype, "sharding": table[idx],
                    "as_bytes": as_bytes})
    manifest = _manifest_digest(args, "load")
    return step, out, manifest, keepers_arg(args, "load")


def _bytes_answer(data: bytes) -> tuple[Any, list]:
    return {}, [bytes(data)]


def _op(name: str, method: str, parse: Callable[..., Any], **kwargs: Any) -> tuple[str, Op]:
    return name, Op(method, parse, spec=op_table.SPECS[name], **kwargs)


# Every operation, with its row of ``mtc.shared.op_table``.
OPS: dict[str, Op] = dict([
    _op("ping", "ping", _none),
    _op("fingerprint", "fingerprint", _none),
    _op("inventory", "committed.inventory", _inventory),
    _op("manifest", "committed.manifest_bytes", _manifest, answer=_bytes_answer),
    _op("part", "saves.part_bytes", _step_only, answer=_bytes_answer),
    _op("write", "saves.write_shards", parse_write),
    _op("read", "read_boxes_each", parse_read, parse_colocated=parse_load),
    _op("commit", "commit", _commit),
    _op("abort", "saves.abort", _step_only, answer=lambda removed: ({"removed": removed}, [])),
    _op("verify", "committed.verify", _step_only),
    _op("lease", "lease.current", _none, answer=lambda lease: ({"lease": lease}, [])),
    _op("claim", "lease.claim", _claim),
    _op("configure", "configure", _configure),
    _op("job", "jobs.poll", _job),
    _op("backup_upload", "backup_upload", _backup_upload),
    _op("backup_finalize", "backup_finalize", _backup_finalize),
    _op("backup_listing", "backup_listing", _backup_listing),
    _op("backup_manifest", "backup_manifest", _backup_manifest, answer=_bytes_answer),
    _op("backup_fetch", "backup_fetch", _backup_fetch),
    _op("peer_pull", "peer_pull", _peer_pull),
    _op("backup_scrub", "backup_scrub", _backup_scrub),
    _op("close", "close", _none, answer=lambda _: (True, [])),
])
if set(OPS) != set(op_table.SPECS):
    raise ImportError(f"mtc.sidecar.ops and mtc.shared.op_table name different operations: "
                      f"{sorted(set(OPS) ^ set(op_table.SPECS))}")

DATA_OPS = frozenset(name for name, op in OPS.items() if op.spec.data)
MUTATING_OPS = frozenset(name for name, op in OPS.items() if op.spec.mutating)
LONG_OPS = frozenset(name for name, op in OPS.items() if op.spec.long)
SERVICE_METHODS = {name: op.method for name, op in OPS.items()}


def method_of(service: Any, name: str) -> Callable[..., Any]:
    """What operation ``name`` calls on ``service``: its row's method, of the service or of the part
    that owns the state (``"saves.write_shards"``: the service's ``SaveWriter``)."""
    return operator.attrgetter(OPS[name].method)(service)


def check(name: str, mode: str) -> Op:
    """The operation ``name`` as served in ``mode`` ("colocated" or "cluster"), or ProtocolError."""
    op = OPS.get(name)
    if op is None:
        known = sorted(n for n, o in OPS.items() if mode in o.spec.modes)
        raise ProtocolError(f"unknown op {name!r}; known ops: {', '.join(known)}")
    if mode not in op.spec.modes:
        raise ProtocolError(f"operation {name!r} is not served in {mode} mode: {op.spec.why}")
    return op


_DATA_PATH = {"colocated": "the ColocatedSidecar method of that name, with the arrays as arguments "
                           "(read: load)",
              "cluster": "a request whose payloads are the shards (write) or that answers them (read)"}


def serve(service: Any, name: str, args: dict, payloads: Sequence[bytes], mode: str) -> tuple[Any, list]:
    """Serve one control request on ``service``: (result, payloads). Raises what the call raised.

    A data operation is refused: its arrays travel on the transport's data path (``data_header``)."""
    op = check(name, mode)
    if op.spec.data:
        raise ProtocolError(f"{name!r} carries arrays, so it is not a control request in {mode} mode; send it as "
                            f"{_DATA_PATH[mode]}")
    service.admit(name, gen_arg(args))
    call_args, call_kwargs = op.parse(args, payloads)
    method = method_of(service, name)
    if op.spec.long:
        return {"job": service.jobs.start(lambda: method(*call_args, **call_kwargs))}, []
    return op.answer(method(*call_args, **call_kwargs))


def data_header(service: Any, name: str, args: dict, carried: int, mode: str) -> Any:
    """The checked header of data operation ``name`` (the row's parser for ``mode``), once the
    operation is known in ``mode`` and admitted (fencing): what a transport's data path calls
    before it reads or writes anything. ``carried``: the payloads (cluster) or array arguments
    (colocated) the request came with."""
    op = check(name, mode)
    if not op.spec.data:
        raise ProtocolError(f"{name!r} is a control request, not a data operation")
    service.admit(name, gen_arg(args))
    return op.parser(mode)(args, carried, mode)
