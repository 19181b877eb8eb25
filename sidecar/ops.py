"""The table of sidecar operations: what each one calls, how its request becomes the call, what it may change.

Each operation's row of plain facts (its request type, fencing, job, data, modes, lane, timeout
class) is ``mtc.shared.op_table``, which the head reads too; ``OPS`` here attaches to each what
it calls on the ``SidecarService`` (a method of the service or of the part that owns the state:
``method_of``) and how the decoded request (``mtc.shared.requests``: one msgspec struct per
operation, its bounds checked in the one call that decodes it) becomes the method's arguments,
and refuses to load if the two tables name different operations.

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
first, which checks the operation, fences it and decodes its header with the row's request type,
before anything is read or written. ``write`` has one header in both modes (``parse_write``): the arrays,
each ``{"index", "shape", "as_bytes"?}``, and in cluster mode ``shards``, one [array, box] per
payload (in colocated mode each array's shards are its own). ``read`` is ``parse_read`` (the boxes
a daemon sends) and, in colocated mode, ``parse_load`` (the arrays to build).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

from msgspec import UNSET

from mtc.shared import format as fmt
from mtc.shared import op_table, requests
from mtc.shared.errors import ManifestError, ProtocolError

if TYPE_CHECKING:
    from mtc.sidecar.service import SidecarService

Args = tuple[tuple, dict]  # the positional and keyword arguments of the service method


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: what it calls on the ``SidecarService``, how its request becomes the call, and
    its row of ``mtc.shared.op_table`` (request type, fencing, job, data, modes, lane, timeout class).

    ``method`` picks the service's own method, or that of the part that owns the state the
    operation reads or changes (``saves``: the ``SaveWriter``; ``committed``: the
    ``CommittedSteps``; ``lease``; ``jobs``), so that the service holds no method that only
    forwards (``method_of``).

    ``call`` is (request, payloads) -> the method's arguments, the request decoded and checked by
    the row's type (``mtc.shared.requests``); a data operation's is (header, carried) -> the header
    its data path takes, ``carried`` the number of payloads (cluster) or array arguments (colocated)
    the request came with, which the header is checked against first."""

    method: Callable[[SidecarService], Callable[..., Any]]
    call: Callable[..., Any]
    answer: Callable[[Any], tuple[Any, list]] = lambda result: (result, [])
    call_colocated: Callable[..., Any] | None = None  # where colocated mode's request differs (``read``)
    spec: op_table.OpSpec = op_table.OpSpec()

    def caller(self, mode: str) -> Callable[..., Any]:
        return self.call_colocated if mode == "colocated" and self.call_colocated is not None else self.call


def root_arg(root: Any, where: str, what: str = "'root'") -> str:
    """A backup root as a request names it (``requests.absolute_root``), or ProtocolError."""
    try:
        return requests.absolute_root(root, what)
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from None


def _payloads(payloads: Sequence[bytes], where: str, *, at_most: int = 1, exactly: int | None = None) -> list[bytes]:
    n = len(payloads)
    if (exactly is not None and n != exactly) or n > at_most:
        want = f"exactly {exactly}" if exactly is not None else f"at most {at_most}"
        raise ProtocolError(f"{where}: {want} payload(s) expected, got {n}")
    return [bytes(p) for p in payloads]


# --- each request as its method's arguments ----------------------------------------------------


def _none(r: requests.Empty, payloads: Sequence[bytes]) -> Args:
    return (), {}


def _step_only(r: requests.StepRequest, payloads: Sequence[bytes]) -> Args:
    return (r.step,), {}


def _manifest(r: requests.Manifest, payloads: Sequence[bytes]) -> Args:
    return (r.step,), {"here_only": r.here_only, "header_only": r.header_only}


def _commit(r: requests.Commit, payloads: Sequence[bytes]) -> Args:
    (manifest,) = _payloads(payloads, "commit (the step manifest, for a keeper)") or [None]
    return (r.step, manifest), {"digest": r.digest, "keepers": [tuple(k) for k in r.keepers] if r.keepers else None}


def _backup_upload(r: requests.BackupUpload, payloads: Sequence[bytes]) -> Args:
    if r.step is not UNSET:  # this host's designated share of the step's boxes, instead of a list of blobs
        return (None,), {"step": r.step, "stand_in": [(x.writer, x.part, x.pieces) for x in r.stand_in]}
    return (r.blobs,), {}


def _backup_finalize(r: requests.BackupFinalize, payloads: Sequence[bytes]) -> Args:
    if not payloads and r.step is not UNSET:  # from this host's own copy of the manifest, checked by its digest
        if r.digest is UNSET:
            raise ProtocolError("backup_finalize: 'digest' must be the manifest's digest (at most 128 characters)")
        return (r.name, None), {"generation": r.gen, "step": r.step, "digest": r.digest}
    (manifest,) = _payloads(payloads, "backup_finalize (the step manifest)", exactly=1)
    return (r.name, manifest), {"generation": r.gen}


def _wants(wants: list[requests.Wanted] | None) -> dict[str, list[fmt.Box] | None] | None:
    """``backup_fetch``'s ``wants`` as array key -> the boxes of it the host loads (None: every box)."""
    if wants is None:
        return None
    out: dict[str, list[fmt.Box] | None] = {}
    for w in wants:
        boxes = None if w.boxes is None else [requests.box(b) for b in w.boxes]
        for k in w.keys:  # a key named twice: the boxes of both (null: every box)
            if k not in out:
                out[k] = boxes
            elif out[k] is not None:
                out[k] = None if boxes is None else out[k] + boxes
    return out


def _backup_scrub(r: requests.BackupScrub, payloads: Sequence[bytes]) -> Args:
    return (r.root, r.blobs, r.repair, r.damaged, r.bytes_per_s), {
        "ramdisk": r.ramdisk, "sizes": r.sizes, "clear": r.clear, "ramdisk_parts": r.ramdisk_parts,
        "parts": [(p.name, list(p.writers)) for p in r.parts]}


def _peer_pull(r: requests.PeerPull, payloads: Sequence[bytes]) -> Args:
    (manifest,) = _payloads(payloads, "peer_pull (the step manifest, to adopt the step)") or [None]
    shares = [(s.owner, s.holders) for s in r.shares or ()]
    adopt = None if r.adopt is None else (r.adopt.digest, list(r.adopt.keepers))
    return (r.step, r.pulls, r.peers, manifest, shares), {"adopt": adopt}


# --- the data operations' headers ---------------------------------------------------------------

def _write_header(r: requests.Write, carried: int) -> requests.Write:
    return r


def _read_header(r: requests.Read, carried: int
                 ) -> tuple[int, list[tuple[str, fmt.Box | None]], str | None, list[int], dict[str, str]]:
    """(step, [(key, box or None)], manifest digest or None, indices to stream, keepers' addresses)."""
    boxes = [(key, None if spans is None else requests.box(spans)) for key, spans in r.reads]
    return r.step, boxes, r.manifest, r.stream, r.keepers


def _load_header(r: requests.Load, carried: int) -> tuple[int, list[dict], str | None, dict[str, str]]:
    """(step, the arrays to build, manifest digest or None, keepers' addresses).

    Each array is ``{"key", "shape", "dtype", "sharding", "as_bytes"}``: the dtype a ``numpy.dtype``,
    the sharding the description of the request's ``"shardings"`` it names (each description sent
    once: a mesh lists every device), to be rebuilt on this host's devices. Arrays of one sharding
    get the same description object."""
    out = []
    for i, a in enumerate(r.arrays):
        try:
            dtype = fmt.dtype_from_name(a.dtype)
        except (ManifestError, TypeError, ValueError) as e:
            raise ProtocolError(f"load: arrays[{i}]: {e}") from None
        out.append({"key": a.key, "shape": a.shape, "dtype": dtype, "sharding": r.shardings[a.sharding],
                    "as_bytes": a.as_bytes})
    return r.step, out, r.manifest, r.keepers


def _header(name: str, args: Any, carried: int, mode: str) -> Any:
    op = OPS[name]
    header = requests.decode("load" if op.call_colocated and mode == "colocated" else name, args,
                             op.spec.request_type(mode))
    header.check(carried, mode)
    return op.caller(mode)(header, carried)


def parse_write(args: dict, carried: int, mode: str) -> requests.Write:
    """A ``write``'s header (``requests.Write``), checked against the ``carried`` payloads (cluster)
    or array arguments (colocated) the request came with."""
    return _header("write", args, carried, mode)


def parse_read(args: dict, carried: int = 0, mode: str = "cluster") -> tuple:
    """A ``read``'s header as the daemon reads it (``_read_header``)."""
    return _header("read", args, carried, mode)


def parse_load(args: dict, carried: int = 0, mode: str = "colocated") -> tuple:
    """A colocated ``load``'s header (``_load_header``)."""
    return _header("read", args, carried, mode)


def _bytes_answer(data: bytes) -> tuple[Any, list]:
    return {}, [bytes(data)]


def _op(name: str, method: Callable[[SidecarService], Callable[..., Any]], call: Callable[..., Any],
        **kwargs: Any) -> tuple[str, Op]:
    return name, Op(method, call, spec=op_table.SPECS[name], **kwargs)


# Every operation, with its row of ``mtc.shared.op_table`` (whose ``request`` type decodes its arguments).
OPS: dict[str, Op] = dict([
    _op("ping", lambda s: s.ping, _none),
    _op("fingerprint", lambda s: s.fingerprint, _none),
    _op("inventory", lambda s: s.committed.inventory, lambda r, p: ((r.devices,), {})),
    _op("manifest", lambda s: s.committed.manifest_bytes, _manifest, answer=_bytes_answer),
    _op("part", lambda s: s.saves.part_bytes, _step_only, answer=_bytes_answer),
    _op("write", lambda s: s.saves.write_shards, _write_header),
    _op("read", lambda s: s.read_boxes_each, _read_header, call_colocated=_load_header),
    _op("commit", lambda s: s.commit, _commit),
    _op("abort", lambda s: s.saves.abort, _step_only, answer=lambda removed: ({"removed": removed}, [])),
    _op("verify", lambda s: s.committed.verify, _step_only),
    _op("lease", lambda s: s.lease.current, _none, answer=lambda lease: ({"lease": lease}, [])),
    _op("claim", lambda s: s.lease.claim, lambda r, p: ((r.generation, r.head), {})),
    _op("configure", lambda s: s.configure, lambda r, p: ((r.settings,), {"generation": r.gen})),
    _op("job", lambda s: s.jobs.poll, lambda r, p: ((r.job, r.wait_s), {})),
    _op("backup_upload", lambda s: s.backup_upload, _backup_upload),
    _op("backup_finalize", lambda s: s.backup_finalize, _backup_finalize),
    _op("backup_listing", lambda s: s.backup_listing, lambda r, p: ((r.root, r.deadline_s), {})),
    _op("backup_manifest", lambda s: s.backup_manifest,
        lambda r, p: ((r.root, r.name, r.header_only), {"among": r.among}), answer=_bytes_answer),
    _op("backup_fetch", lambda s: s.backup_fetch, lambda r, p: ((r.name, r.blobs, r.parts), {"wants": _wants(r.wants)})),
    _op("peer_pull", lambda s: s.peer_pull, _peer_pull),
    _op("backup_scrub", lambda s: s.backup_scrub, _backup_scrub),
    _op("close", lambda s: s.close, _none, answer=lambda _: (True, [])),
])
if set(OPS) != set(op_table.SPECS):
    raise ImportError(f"mtc.sidecar.ops and mtc.shared.op_table name different operations: "
                      f"{sorted(set(OPS) ^ set(op_table.SPECS))}")

DATA_OPS = frozenset(name for name, op in OPS.items() if op.spec.data)
MUTATING_OPS = frozenset(name for name, op in OPS.items() if op.spec.mutating)
LONG_OPS = frozenset(name for name, op in OPS.items() if op.spec.long)
SERVICE_METHODS = {name: op.method for name, op in OPS.items()}


def method_of(service: SidecarService, name: str) -> Callable[..., Any]:
    """What operation ``name`` calls on ``service``: its row's method, of the service or of the part
    that owns the state (``write``: the service's ``SaveWriter``'s ``write_shards``)."""
    return OPS[name].method(service)


def check(name: str, mode: str) -> Op:
    """The operation ``name`` as served in ``mode`` ("colocated" or "cluster"), or ProtocolError."""
    op = OPS.get(name)
    if op is None:
        known = sorted(n for n, o in OPS.items() if mode in o.spec.modes)
        raise ProtocolError(f"unknown op {name!r}; known ops: {', '.join(known)}")
    if mode not in op.spec.modes:
        raise ProtocolError(f"operation {name!r} is not served in {mode} mode: {op.spec.why}")
    return op


def admit(service: SidecarService, name: str, args: Any) -> None:
    """Fencing, before anything else of the request is read: the head's generation (``gen``)."""
    service.admit(name, requests.decode(name, args, requests.Request).gen)


_DATA_PATH = {"colocated": "the ColocatedSidecar method of that name, with the arrays as arguments "
                           "(read: load)",
              "cluster": "a request whose payloads are the shards (write) or that answers them (read)"}


def serve(service: SidecarService, name: str, args: dict, payloads: Sequence[bytes], mode: str) -> tuple[Any, list]:
    """Serve one control request on ``service``: (result, payloads). Raises what the call raised.

    A data operation is refused: its arrays travel on the transport's data path (``data_header``)."""
    op = check(name, mode)
    if op.spec.data:
        raise ProtocolError(f"{name!r} carries arrays, so it is not a control request in {mode} mode; send it as "
                            f"{_DATA_PATH[mode]}")
    admit(service, name, args)
    call_args, call_kwargs = op.call(requests.decode(name, args, op.spec.request), payloads)
    method = op.method(service)
    if op.spec.long:
        return {"job": service.jobs.start(lambda: method(*call_args, **call_kwargs))}, []
    return op.answer(method(*call_args, **call_kwargs))


def data_header(service: SidecarService, name: str, args: dict, carried: int, mode: str) -> Any:
    """The checked header of data operation ``name`` (``parse_write``; ``parse_read``, or in colocated
    mode ``parse_load``), once the operation is known in ``mode`` and admitted (fencing): what a
    transport's data path calls before it reads or writes anything. ``carried``: the payloads
    (cluster) or array arguments (colocated) the request came with."""
    op = check(name, mode)
    if not op.spec.data:
        raise ProtocolError(f"{name!r} is a control request, not a data operation")
    admit(service, name, args)
    return _header(name, args, carried, mode)
