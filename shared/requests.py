"""One typed request per sidecar operation, shared by the head (which builds it) and the sidecar
(which decodes it): ``msgspec`` structs with their bounds, decoded and checked in one call.

A request travels as a JSON object (``to_wire``): the head builds the struct of its operation
(``Claim(generation=g, head=...)``) and a transport moves its ``to_wire()``; the sidecar's
``decode(op, args)`` turns that object back into the struct or raises ``ProtocolError``, naming
the argument, its bound and what was sent. Every number and string an operation accepts is
bounded here, so that nothing the service does with it (a file name, a path, a metric) can fail
on its size or content. A field the struct does not know is passed over, as the hand-written
checks did (the colocated transport's request carries its own keys: ``op``, ``per_host``, ...).

The frame decoder (``protocol.loads_message``) has already refused integers past 64 bits,
numbers that are not finite and strings with a lone surrogate; the checks msgspec cannot state
(an absolute root, an index into another field, a header's size as JSON) are each struct's
``__post_init__``; those that need what came with the request (the payloads, the arrays) are
the data headers' ``check``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from mtc.shared import format as fmt
from mtc.shared import shardings
from mtc.shared.errors import ManifestError, ProtocolError

MAX_STEP = 10**12 - 1  # a step names files with 12 digits
MAX_GENERATION = 2**63 - 1  # a head's generation (microseconds since the epoch, or one more than the lease's)
MAX_INDEX = 2**31 - 1  # a device id, an array index, a part number
MAX_WAIT_S = 10.0  # the longest one ``job`` call waits: below every transport's patience for one answer
MAX_DEADLINE_S = 24 * 3600.0  # how long a listing may retry an unreachable store
MAX_ROOT_CHARS = 4096  # a backup root (PATH_MAX)
MAX_NAME_CHARS = 255  # a backup name (NAME_MAX)
MAX_HEAD_CHARS = 4096  # a claiming head's description, as JSON (kept in the lease file)
MAX_SETTING = 2**53  # a count or rate of the head's settings (exact as a metric's float)
MAX_KEEPERS = 64  # hosts that keep a step's whole manifest
_URL_SCHEMES = ("gs://", "file:///")

_NO_NUL = r"\A[^\x00]*\Z"
Step = Annotated[int, Meta(ge=0, le=MAX_STEP)]
Generation = Annotated[int, Meta(ge=1, le=MAX_GENERATION)]
Index = Annotated[int, Meta(ge=0, le=MAX_INDEX)]
Count = Annotated[int, Meta(ge=0)]
Size = Annotated[int, Meta(ge=0, le=MAX_SETTING)]  # one size of an array's shape
Shape = Annotated[tuple[Size, ...], Meta(max_length=64)]
Digest = Annotated[str, Meta(max_length=128)]
BlobName = Annotated[str, Meta(pattern=r"\A[0-9a-f]{32}\Z")]
BackupName = Annotated[str, Meta(pattern=r"\A\d{8}T\d{6}Z-step-\d{12}\Z")]
HostId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]  # ``protocol.check_host_id``
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS, pattern=_NO_NUL)]
Root = Annotated[str, Meta(min_length=1, max_length=MAX_ROOT_CHARS, pattern=_NO_NUL)]
Point = Annotated[int, Meta(ge=0, le=2**63 - 1)]


def absolute_root(root: Any, what: str = "'root'") -> str:
    """A backup root as a request names it: a non-empty text of at most ``MAX_ROOT_CHARS`` without NUL,
    and absolute: a path, ``file:///...`` or ``gs://...`` (ValueError otherwise).

    A relative path is refused: it would name a folder under the sidecar's working directory,
    not the head's backup root (the head sends its root absolute)."""
    if not isinstance(root, str) or not root or len(root) > MAX_ROOT_CHARS or "\0" in root:
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_ROOT_CHARS} characters without NUL, "
                         f"got {root!r:.80}")
    if not (root.startswith("/") or root.lower().startswith(_URL_SCHEMES)):
        raise ValueError(f"{what} {root!r:.80} is not absolute; give the backup root as an absolute path, "
                         "file:///path or gs://bucket/prefix")
    return root


class Span(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """[start, stop] of one dimension of a box."""

    start: Point
    stop: Point

    def __post_init__(self):
        if self.start > self.stop:
            raise ValueError(f"[{self.start}, {self.stop}] has start > stop; a box is a list of [start, stop] "
                             "pairs (0 <= start <= stop < 2**63)")


Box = list[Span]


def box(spans: list[Span]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in spans)


# --- requests ---------------------------------------------------------------------------------


class Request(Struct, kw_only=True, omit_defaults=True):
    """What every request may carry: ``gen``, the generation of the head that sends it (fencing)."""

    gen: Generation | None = None

    # the fields that differ from host to host where the head sends one request to each of several
    # hosts (the head's ``wire_per_host``); the others are the same for all
    PER_HOST: ClassVar[tuple[str, ...]] = ()
    # field path -> what it must be, the message of a refusal: ``[*]``, any position of a list;
    # ``{at}``, the argument's path in the request, ``{up}`` that of the object or list it is in
    WHY: ClassVar[dict[str, str]] = {}

    def to_wire(self) -> dict:
        """The JSON object a transport moves (defaults left out)."""
        return msgspec.to_builtins(self)


_WHY_BASE = {
    "gen": "'gen' must be the head's generation, an integer in [1, 2**63 - 1]",
}
_WHY_STEP = {"step": f"'step' must be an integer in [0, {MAX_STEP}]"}
_WHY_ROOT = {"root": f"'root' must be a non-empty string of at most {MAX_ROOT_CHARS} characters without NUL"}
_WHY_NAME = {"name": f"'name' (the backup's name) must be a non-empty string of at most {MAX_NAME_CHARS} "
                     "characters without NUL"}
_WHY_BLOBS = {"blobs": "'blobs' must be a list of blob names (32 lowercase hex digits)"}
_WHY_KEEPERS = {"keepers": f"'keepers' must map at most {MAX_KEEPERS} host ids to peer addresses"}
_WHY_MANIFEST = {"manifest": "'manifest' must be the step manifest's digest (a string of at most 128 characters) "
                             "or null"}


class Empty(Request, kw_only=True):
    """An operation without arguments (``ping``, ``fingerprint``, ``lease``, ``close``)."""


class StepRequest(Request, kw_only=True):
    """An operation on one step (``part``, ``abort``, ``verify``)."""

    step: Step
    WHY = _WHY_STEP


class Inventory(Request, kw_only=True):
    devices: list[Index] | None = None  # the head's device ids whose shards this host holds
    PER_HOST = ("devices",)
    WHY = {"devices": f"'devices' must be a list of device ids (integers in [0, {MAX_INDEX}])"}


class Manifest(Request, kw_only=True):
    step: Step
    here_only: bool = False  # RecordOnlyError where the host keeps only a record of the step
    header_only: bool = False  # the manifest's first line alone
    WHY = {**_WHY_STEP, "here_only": "'here_only' must be true or false",
           "header_only": "'header_only' must be true or false"}


KeeperText = Annotated[str, Meta(max_length=255, pattern=_NO_NUL)]


class Commit(Request, kw_only=True):
    """Phase 2 of a save; the step manifest is the one payload a keeper gets."""

    step: Step
    digest: Digest | None = None
    keepers: list[tuple[KeeperText, KeeperText]] | None = None  # [host, peer address]
    WHY = {**_WHY_STEP, "digest": "'digest' is not a digest (a string of at most 128 characters)",
           "keepers": "'keepers' is not a list of [host, peer address]"}


class Claim(Request, kw_only=True):
    generation: Generation
    head: dict[str, Any]  # who the head is (host, pid, start), kept in the lease file
    WHY = {"generation": "'generation' must be the head's generation, an integer in [1, 2**63 - 1]",
           "head": f"'head' must be an object naming the head, at most {MAX_HEAD_CHARS} characters as JSON"}

    def __post_init__(self):
        if len(json.dumps(self.head)) > MAX_HEAD_CHARS:
            raise ValueError(f"'head' must be an object naming the head, at most {MAX_HEAD_CHARS} characters as JSON")


class Configure(Request, kw_only=True):
    settings: dict[str, Any]  # ``HostSettings.to_wire``: checked by the service against its own fields
    WHY = {"settings": "'settings' must be an object of the head's settings"}

    def __post_init__(self):
        for key in ("local_max_to_keep", "backup_max_to_keep", "backup_scrub_bytes_per_s"):
            v = self.settings.get(key, 1)
            if type(v) is int and v > MAX_SETTING:
                raise ValueError(f"{key} must be at most {MAX_SETTING}, got {v!r:.50}")
        url = self.settings.get("backup_url")
        if url is not None:
            absolute_root(url, "backup_url")


class Job(Request, kw_only=True):
    job: Annotated[str, Meta(max_length=64, pattern=r"\A[^\W_]+\Z")]  # ``str.isalnum``
    wait_s: Annotated[float, Meta(ge=0, le=MAX_WAIT_S)] = 0.0
    WHY = {"job": "'job' must be the id a long operation answered with",
           "wait_s": f"'wait_s' must be a number in [0, {MAX_WAIT_S:g}]"}


class StandIn(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A writer gone from the step (its part lost) whose designated share of the boxes this host uploads:
    read from the rows of ``part``, the writer's own (a peer copy this host keeps) or a data-parallel twin's
    (the same boxes, this host's own part). With ``pieces``, this host holds pieces of the part only and
    uploads the blobs of the share that it holds (the other holders of pieces upload the rest)."""

    writer: HostId
    part: HostId
    pieces: bool = False


class BackupUpload(Request, kw_only=True):
    """The blobs to upload, or ``step``: this host's designated share of the step's boxes, and those of the
    writers it stands in for (``stand_in``)."""

    blobs: list[BlobName] | UnsetType = UNSET
    step: Step | UnsetType = UNSET
    stand_in: list[StandIn] = []
    PER_HOST = ("blobs", "step", "stand_in")
    WHY = {**_WHY_BLOBS, **_WHY_STEP,
           "stand_in": "'stand_in' must list [writer, part] host ids (and whether it holds pieces only)"}

    def __post_init__(self):
        if self.step is not UNSET and self.blobs is not UNSET:
            raise ValueError("give 'blobs' or 'step', not both")
        if self.step is UNSET and self.blobs is UNSET:
            raise ValueError("'blobs' must be a list of blob names (32 lowercase hex digits), or give 'step'")
        if self.stand_in and self.step is UNSET:
            raise ValueError("'stand_in' goes with 'step'")


class BackupFinalize(Request, kw_only=True):
    """With the step manifest as its one payload; without, ``step`` and ``digest``: this host's own copy."""

    name: Name
    step: Step | UnsetType = UNSET
    digest: Annotated[str, Meta(min_length=1, max_length=128)] | UnsetType = UNSET
    WHY = {**_WHY_NAME, **_WHY_STEP, "digest": "'digest' must be the manifest's digest (at most 128 characters)"}


class _Rooted(Request, kw_only=True):
    root: Root | None = None  # None: the root the host was configured with

    def __post_init__(self):
        if self.root is not None:
            absolute_root(self.root)


class BackupListing(_Rooted, kw_only=True):
    deadline_s: Annotated[float, Meta(ge=0, le=MAX_DEADLINE_S)] | None = None
    WHY = {**_WHY_ROOT, "deadline_s": f"'deadline_s' must be a number in [0, {MAX_DEADLINE_S:g}] or null"}


class BackupManifest(_Rooted, kw_only=True):
    name: Name
    header_only: bool = False  # its header line alone, by the backup's part index (b"": it has none)
    # Instead of the manifest: those of these blobs it names (their names, joined): the host reads it.
    among: list[BlobName] | None = None
    WHY = {**_WHY_ROOT, **_WHY_NAME, "among": "'among' must be a list of blob names (32 lowercase hex digits) or null"}


class Wanted(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """Arrays a host loads from a backup (their keys) and the boxes of them it loads, the same for
    each (the arrays of one target sharding and shape); ``boxes`` null: every box of them."""

    keys: list[str]
    boxes: list[Box] | None = None


class BackupFetch(Request, kw_only=True):
    name: Name
    blobs: list[BlobName]
    # Instead of blobs: every blob of these writers' parts, which the host reads with the header by range.
    parts: list[HostId] | None = None
    # With parts: only the blobs of the arrays it will load whose boxes overlap those it will load (a
    # resized restore reads some of a writer's boxes; a partial restore some arrays). None: every blob.
    wants: list[Wanted] | None = None
    PER_HOST = ("blobs", "parts", "wants")
    WHY = {**_WHY_NAME, **_WHY_BLOBS,
           "wants": "'wants' must be a list of [keys, boxes or null] (array keys, and boxes of [start, stop] pairs)",
           "wants[*]": "{at} is not [keys, boxes or null]",
           "wants[*][1]": "{up}: boxes is not a list of boxes (lists of [start, stop] pairs, "
                          "0 <= start <= stop < 2**63) or null"}


class ScrubPart(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A backup whose blobs a host hashes by parts: it reads the parts of ``writers`` with the header, by
    range, and hashes the blobs of each that fall to that writer (``fmt.writers.designated``)."""

    name: BackupName
    writers: list[HostId]


class BackupScrub(_Rooted, kw_only=True):
    blobs: list[BlobName] = []  # to hash in the store
    parts: list[ScrubPart] = []  # ... and the blobs of these backups' parts it reads
    ramdisk_parts: bool = False  # first, its ramdisk copies of every blob of those parts
    repair: list[BlobName] = []  # to re-upload from the ramdisk where it holds good copies
    damaged: dict[BackupName, Annotated[str, Meta(max_length=4096)]] = {}  # backup -> why, to mark
    bytes_per_s: Annotated[float, Meta(gt=0, le=MAX_SETTING)] | None = None  # None: the configured cap
    ramdisk: list[BlobName] = []
    sizes: dict[str, Annotated[int, Meta(ge=0, le=2**63 - 1)]] = {}  # blob -> its size in bytes
    clear: list[BackupName] = []
    PER_HOST = ("blobs", "parts", "repair", "damaged", "ramdisk", "sizes", "clear")
    WHY = {**_WHY_ROOT, **_WHY_BLOBS,
           "parts": "'parts' must be a list of [backup name, [writer host ids]]",
           "parts[*]": "{at} is not [backup name, [writer host ids]]",
           "repair": "'repair' must be a list of blob names (32 lowercase hex digits)",
           "ramdisk": "'ramdisk' must be a list of blob names (32 lowercase hex digits)",
           "damaged": "'damaged' must be an object of backup name -> why (at most 4096 characters)",
           "bytes_per_s": "'bytes_per_s' must be a number > 0 (the bandwidth cap) or null",
           "sizes": "'sizes' must be an object of blob name -> its size in bytes",
           "clear": "'clear' must be a list of backup names"}


class Pull(Struct, array_like=True, forbid_unknown_fields=True, frozen=True, gc=False):
    """One blob to fetch: its name, its size (from the manifest) and the holders to try, in order."""

    blob: BlobName
    size: Count
    sources: Annotated[tuple[HostId, ...], Meta(min_length=1)]


class Share(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """Every blob of ``owner``'s share (listed from the host's own copy of the manifest), from ``holders``."""

    owner: HostId
    holders: Annotated[tuple[HostId, ...], Meta(min_length=1)]


class Adopt(Struct):
    """Fetch the step's manifest (``digest``) from a keeper, and commit the step once the pulls succeeded."""

    digest: Annotated[str, Meta(min_length=1, max_length=128)]
    keepers: Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=MAX_KEEPERS)]


_ADDRESS = re.compile(r"\A.+:\d+\Z", re.S)


class PeerPull(Request, kw_only=True):
    step: Step
    peers: dict[HostId, str]  # host id -> "host:port" of its peer service
    pulls: list[Pull] = []
    shares: list[Share] | None = None
    adopt: Adopt | None = None
    PER_HOST = ("pulls", "shares")
    WHY = {**_WHY_STEP, "peers": "'peers' must map host ids to peer addresses",
           "pulls": "'pulls' must be a list of [blob, size, [holders]]",
           "pulls[*]": "{at} is not [blob name, size >= 0, [holder, ...]] (holders: host ids)",
           "shares": "'shares' must be a list of [owner host, [holders]]",
           "shares[*]": "{at} is not [owner host, [holder, ...]] (host ids)",
           "adopt": "'adopt' must be {digest: the manifest's digest, keepers: [host ids]}"}

    def __post_init__(self):
        for h, addr in self.peers.items():
            if not _ADDRESS.match(addr) or not 0 <= int(addr.rpartition(":")[2]) <= 65535:
                raise ValueError(f"peers[{h!r:.70}]: address {addr!r:.80} is not host:port (e.g. 127.0.0.1:7000)")


# --- the data operations' headers -------------------------------------------------------------


class WriteArray(Struct, gc=False):
    """One array of a ``write``: the leaf's index in the state and its shape, which every box of
    its shards lies in; ``as_bytes``: it travels as its flat bytes (a host numpy leaf), so its one
    box is its whole shape."""

    index: Index
    shape: Shape
    as_bytes: bool = False


class Shard(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    array: Count  # a position in the header's ``arrays``
    box: Box


class Write(Request, kw_only=True):
    """``write``'s header, one in both modes: the arrays, and in cluster mode ``shards``, one
    [position in ``arrays``, box] per payload (in colocated mode each array's shards are its own)."""

    step: Step
    arrays: list[WriteArray]
    part: Index = 0
    shards: list[Shard] | None = None
    WHY = {**_WHY_STEP, "part": f"'part' must be an integer in [0, {MAX_INDEX}]",
           "arrays": "'arrays' must be a list of {index, shape, as_bytes?}",
           "arrays[*]": f"{{at}}: 'index' must be the leaf's index, an integer in [0, {MAX_INDEX}] (each row an "
                        "object {index, shape, as_bytes?})",
           "arrays[*].index": f"{{up}}: 'index' must be the leaf's index, an integer in [0, {MAX_INDEX}]",
           "arrays[*].shape": "{up}: 'shape' must be a list of at most 64 sizes (integers in [0, 2**53])",
           "arrays[*].as_bytes": "{up}: 'as_bytes' must be true or false",
           "shards": "'shards' must list one [array, box] per payload",
           "shards[*]": "{at} is not [array, box] with array a position in 'arrays'",
           "shards[*][1]": "{up}: box is not a list of [start, stop] pairs (0 <= start <= stop < 2**63)"}

    def __post_init__(self):
        seen = set()
        for i, a in enumerate(self.arrays):
            if a.index in seen:
                raise ValueError(f"arrays[{i}]: 'index' {a.index} is listed twice; list each array once")
            seen.add(a.index)

    def check_arrays(self, shapes: list[tuple[tuple[int, ...], Any]]) -> None:
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

    def check(self, carried: int, mode: str) -> None:
        """Against what came with the request: ``carried`` payloads (cluster: one per shard) or arrays
        (colocated: one per row of ``arrays``); each shard's box lies in its array's shape."""
        if mode == "colocated":
            if len(self.arrays) != carried:
                raise ProtocolError(f"write: 'arrays' must list one row per array sent ({carried} arrays), "
                                    f"got {len(self.arrays)}")
            if self.shards is not None:
                raise ProtocolError("write: 'shards' is not sent in colocated mode: each array's shards are its own")
            return
        if self.shards is None or len(self.shards) != carried:
            raise ProtocolError(f"write: 'shards' must list one [array, box] per payload ({carried} payloads), "
                                f"got {None if self.shards is None else len(self.shards)} rows")
        for i, row in enumerate(self.shards):
            if row.array >= len(self.arrays):
                raise ProtocolError(f"write: shards[{i}] is not [array, box] with array a position in 'arrays' "
                                    f"(which has {len(self.arrays)} rows), got array {row.array}")
            spec = self.arrays[row.array]
            if len(row.box) != len(spec.shape) or any(s.stop > n for s, n in zip(row.box, spec.shape)):
                raise ProtocolError(f"write: shards[{i}]: box {_box_str(row.box)} does not lie in the array's "
                                    f"'shape' {list(spec.shape)}")
            if spec.as_bytes and any(s.start != 0 or s.stop != n for s, n in zip(row.box, spec.shape)):
                raise ProtocolError(f"write: shards[{i}]: array {spec.index} is 'as_bytes': its one box is its "
                                    f"whole 'shape' {list(spec.shape)}, got {_box_str(row.box)}")


def _box_str(spans: list[Span]) -> str:
    return fmt.box_str(box(spans))


def _no_payloads(op: str, carried: int) -> None:
    if carried:
        raise ProtocolError(f"{op}: the request carries no payloads, got {carried}")


Keepers = Annotated[dict[Annotated[str, Meta(min_length=1, max_length=256)],
                         Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=MAX_KEEPERS)]


class Read(Request, kw_only=True):
    """``read`` (cluster): the boxes to send, [key, box or null (the whole array)] each; ``stream``:
    the indices of those the head hashes itself; ``manifest``: the digest of the step manifest
    (a host whose copy differs reads nothing); ``keepers``: host -> peer address of the hosts that
    keep the whole manifest, where a host that committed a record fetches the header."""

    step: Step
    reads: list[tuple[str, Box | None]]
    manifest: Digest | None = None
    stream: list[Count] = []
    keepers: Keepers = {}
    WHY = {**_WHY_STEP, **_WHY_MANIFEST, **_WHY_KEEPERS,
           "reads": "'reads' must be a list of [key, box or null]",
           "reads[*]": "{at} is not [key, box or null]",
           "reads[*][1]": "{up}: box is not a list of [start, stop] pairs (0 <= start <= stop < 2**63)",
           "stream": "'stream' must list indices into 'reads' (the boxes the head hashes itself)"}

    def __post_init__(self):
        if any(i >= len(self.reads) for i in self.stream):
            raise ValueError("'stream' must list indices into 'reads' (the boxes the head hashes itself)")

    def check(self, carried: int, mode: str) -> None:
        _no_payloads("read", carried)


class LoadArray(Struct, gc=False):
    """One array a colocated ``load`` builds: its key, shape and dtype (a name), its sharding (an
    index into the request's ``shardings``)."""

    key: str
    shape: Shape
    dtype: str
    sharding: Count
    as_bytes: bool = False


class Load(Request, kw_only=True):
    """``read`` in colocated mode: the arrays to build on this host's devices; each sharding
    description is sent once (a mesh lists every device) and rebuilt where it is used."""

    step: Step
    arrays: list[LoadArray]
    shardings: list[dict[str, Any]]
    manifest: Digest | None = None
    keepers: Keepers = {}
    WHY = {**_WHY_STEP, **_WHY_MANIFEST, **_WHY_KEEPERS,
           "arrays": "'arrays' must be a list of {key, shape, dtype, sharding}",
           "arrays[*]": "{at} is not an object with a 'key' (text)",
           "arrays[*].key": "{up} is not an object with a 'key' (text)",
           "arrays[*].shape": "{up}: 'shape' must be a list of at most 64 sizes (integers in [0, 2**53])",
           "arrays[*].dtype": "{up}: 'dtype' must be a dtype's name",
           "arrays[*].sharding": "{up}: 'sharding' must be an index into 'shardings'",
           "arrays[*].as_bytes": "{up}: 'as_bytes' must be true or false",
           "shardings": "'shardings' must be a list of sharding descriptions"}

    def __post_init__(self):
        try:
            self.shardings = [shardings.unpack(d, f"shardings[{i}]") for i, d in enumerate(self.shardings)]
        except ManifestError as e:
            raise ValueError(str(e)) from None
        for i, a in enumerate(self.arrays):
            if a.sharding >= len(self.shardings):
                raise ValueError(f"arrays[{i}]: 'sharding' must be an index into 'shardings' (0 to "
                                 f"{len(self.shardings) - 1})")

    def check(self, carried: int, mode: str) -> None:
        _no_payloads("load", carried)


# --- decoding, and the messages of a refusal --------------------------------------------------

_MSGSPEC_SAYS = ("Expected ", "Object missing required field", "Object contains unknown field", "Invalid ")
_AT = re.compile(r" - at `\$(.*)`\Z", re.S)
_MISSING = re.compile(r"\AObject missing required field `([^`]*)`")
_SEGMENT = re.compile(r"\.([^.\[]+)|(\[[^\]]*\])")


def decode(op: str, args: Any, cls: type[Request]) -> Any:
    """``args`` (a decoded JSON object) as request ``cls`` of operation ``op``, checked; ProtocolError
    naming the argument, its bound and what was sent."""
    try:
        return msgspec.convert(args, cls, strict=True)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"{op}: {refusal(str(e), args, cls)}") from None


def refusal(said: str, args: Any, cls: type[Request]) -> str:
    """msgspec's ``said`` (``Expected `int` <= 10 - at `$.step```) as the argument's own words."""
    m = _AT.search(said)
    path, said = (m.group(1), said[:m.start()]) if m else ("", said)
    missing = _MISSING.match(said)
    if missing:
        path += f".{missing.group(1)}"
    segments = [a or b for a, b in _SEGMENT.findall(path)]
    if not said.startswith(_MSGSPEC_SAYS):  # a struct's own check (``__post_init__``): its words
        where = _concrete(segments)
        return f"{where}: {said}" if where else said
    for n in range(len(segments), 0, -1):
        why = _why(cls.WHY, segments[:n]) or (_WHY_BASE.get(segments[0]) if n == 1 else None)
        if why is not None:
            got = "nothing" if missing and n == len(segments) else f"{_value(args, segments[:n])!r:.80}"
            why = why.replace("{at}", _concrete(segments[:n])).replace("{up}", _concrete(segments[:n - 1]))
            return f"{why}, got {got}"
    return f"{said} at {_concrete(segments) or 'the request'}"


def _why(table: dict[str, str], segments: list[str]) -> str | None:
    for key, why in table.items():
        parts = [a or b for a, b in _SEGMENT.findall("." + key)]
        if len(parts) == len(segments) and all(p == s or (p == "[*]" and s.startswith("["))
                                               for p, s in zip(parts, segments)):
            return why
    return None


def _concrete(segments: list[str]) -> str:
    return "".join(s if s.startswith("[") or i == 0 else f".{s}" for i, s in enumerate(segments))


def _value(doc: Any, segments: list[str]) -> Any:
    for s in segments:
        try:
            doc = doc[int(s[1:-1])] if s.startswith("[") else doc[s]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return doc
