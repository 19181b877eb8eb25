"""What a host reports across the seam: its inventory and what its peer pulls did (one definition
in both modes, as ``host_settings`` is for what the head sends).

The sidecar builds a ``HostInventory`` or a ``PullResult`` and answers its ``to_wire()``; the head
parses the answer with ``from_wire(host, doc)``, which checks every field and raises
``ProtocolError`` naming the host and the field. ``error`` is the head's own note for a host it could
not ask (``unreachable``): it never travels.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar

import msgspec

from mtc.shared import protocol, requests
from mtc.shared.errors import ProtocolError

_SAME_VERSION = "run the same mtc version on the head and every sidecar"


def _unknown(doc: dict, known: set[str]) -> list[str]:
    return sorted(str(k) for k in set(doc) - known)


@dataclasses.dataclass(frozen=True)
class StepHolding:
    """One committed step on one host, as the host's inventory reports it.

    ``blobs``/``local_blobs``: this host's own share of the step (the shards of its devices)
    and how many of those it holds; ``held`` is the bitmap (``protocol.encode_bitmap``) over
    all ``step_blobs`` blobs of the step, in the order whose digest is ``digest``.
    """

    step: int
    blobs: int
    local_blobs: int
    step_blobs: int
    digest: str
    held: str
    manifest: str = ""  # the digest of this host's copy of the step manifest
    # True when the host committed a record (not the whole manifest): then ``held`` is over the
    # sorted blobs of its own part of the step (``StepManifest.part_blobs``), ``step_blobs`` their count.
    part: bool = False
    # The digest of this host's own share's sorted blob names: hosts whose shares are equal
    # (data-parallel twins) hold copies of each other's whole share.
    own: str = ""
    # The digests of the shares this host holds whole (a host that keeps the whole manifest: its
    # own and the copies it keeps for others; a record host reports none, its counts say).
    copies: tuple[str, ...] = ()
    # The writers (not this host) whose parts this host holds whole: peer copies, and the parts of its
    # data-parallel twins (the same share): where a restore finds a lost writer's part without a blob name.
    parts: tuple[str, ...] = ()
    # (writer, n, bitmap): the writers whose parts this host holds some but not all of, beyond its own share
    # and the parts it holds whole (a peer copy that a per-blob replication spread over several hosts, or one
    # cut short): the bitmap (``protocol.encode_bitmap``) over the writer's part's n sorted blob names. The
    # pieces of a lost writer's part that several hosts hold restore it without a blob row on the head.
    pieces: tuple[tuple[str, int, str], ...] = ()

    _FIELDS = frozenset({"step", "blobs", "local_blobs", "step_blobs", "digest", "held", "manifest", "part", "own",
                         "copies", "parts", "pieces"})

    def to_wire(self) -> dict:
        return {"step": self.step, "blobs": self.blobs, "local_blobs": self.local_blobs,
                "step_blobs": self.step_blobs, "digest": self.digest, "held": self.held, "manifest": self.manifest,
                "part": self.part, "own": self.own, "copies": list(self.copies),
                **({"parts": list(self.parts)} if self.parts else {}),
                **({"pieces": [list(p) for p in self.pieces]} if self.pieces else {})}

    @classmethod
    def from_wire(cls, host: str, s: Any) -> "StepHolding":
        """One step of a host's inventory answer, decoded and checked in one call (``_HoldingAnswer``);
        ProtocolError names the host, the step and the field. An entry without the step's counts or
        its blob bitmap is said to come from another mtc version."""
        if not (isinstance(s, dict) and all(type(s.get(k)) is int for k in ("step", "blobs", "local_blobs"))):
            raise ProtocolError(f"host {host}: malformed inventory entry {s!r:.200}")
        where = f"host {host}: inventory of step {s['step']}"
        if type(s.get("step_blobs")) is not int or not isinstance(s.get("digest"), str) \
                or not isinstance(s.get("held"), str):
            raise ProtocolError(f"{where} lacks its blob bitmap; {_SAME_VERSION}")
        a = _decode(s, _HoldingAnswer, where, cls._FIELDS)
        pieces = tuple((w, n, bits) for w, n, bits in a.pieces)
        for w, n, bits in pieces:
            try:
                protocol.decode_bitmap(bits, n)
            except ProtocolError as e:
                raise ProtocolError(f"{where}: 'pieces' of writer {w!r:.100}: {e}") from None
        return cls(a.step, a.blobs, a.local_blobs, a.step_blobs, a.digest, a.held, a.manifest, a.part, a.own,
                   tuple(a.copies), tuple(a.parts), pieces)


@dataclasses.dataclass(frozen=True)
class HostInventory:
    """What one host holds. ``error`` is set (and ``steps`` empty) when the host could not be
    asked: it confirms nothing while it is down."""

    host: str
    steps: tuple[StepHolding, ...] = ()
    error: str | None = None
    damaged: tuple[int, ...] = ()  # steps committed here whose manifest copy fails its checks
    # (step, why, seconds ago): steps whose last peer pull on this host failed (a full ramdisk, ...)
    pull_failures: tuple[tuple[int, str, float], ...] = ()
    ramdisk: tuple[int, int] | None = None  # (free bytes, size bytes) of its ramdisk when it answered

    _FIELDS = frozenset({"host", "steps", "damaged", "pull_failures", "ramdisk"})

    @classmethod
    def unreachable(cls, host: str, cause: str) -> "HostInventory":
        return cls(host=host, error=cause)

    def to_wire(self) -> dict:
        """The sidecar's answer to ``inventory`` (a host that answers has no ``error``)."""
        if self.error is not None:
            raise ValueError(f"host {self.host}: an unreachable host's inventory is the head's note, not an answer")
        doc: dict = {"host": self.host, "steps": [s.to_wire() for s in self.steps], "damaged": list(self.damaged)}
        if self.pull_failures:
            doc["pull_failures"] = [{"step": s, "error": why, "age_s": age} for s, why, age in self.pull_failures]
        if self.ramdisk is not None:
            doc["ramdisk"] = {"free_bytes": self.ramdisk[0], "size_bytes": self.ramdisk[1]}
        return doc

    @classmethod
    def from_wire(cls, host: str, doc: Any) -> "HostInventory":
        """Parse a sidecar's inventory answer; ProtocolError names the host and the field when it is malformed."""
        rows = doc.get("steps") if isinstance(doc, dict) else None
        if not isinstance(rows, list):
            raise ProtocolError(f"host {host}: malformed inventory {doc!r:.200}")
        said = doc.get("host", host)
        if said != host:
            raise ProtocolError(f"host {host}: the inventory is that of host {said!r:.100}; the host ids of the "
                                "head's topology and of the sidecars differ")
        a = _decode(doc, _InventoryAnswer, f"host {host}: inventory", cls._FIELDS, joiner=" ")
        return cls(host=host, steps=tuple(StepHolding.from_wire(host, s) for s in rows), damaged=tuple(a.damaged),
                   pull_failures=tuple((n.step, n.error, n.age_s) for n in a.pull_failures),
                   ramdisk=None if a.ramdisk is None else (a.ramdisk.free_bytes, a.ramdisk.size_bytes))


@dataclasses.dataclass(frozen=True)
class PullResult:
    """What one host did with its peer pulls. ``error`` is set when the host could not be asked
    or failed as a whole (then nothing else is known); otherwise ``failed`` lists the blobs no
    holder had a good copy of, with (holder, cause) per holder tried."""

    host: str
    pulled: int = 0
    pulled_bytes: int = 0
    failed: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    bad_copies: tuple[tuple[str, str, str], ...] = ()  # (blob, holder, cause): copies that failed their hash
    removed_bad_copies: tuple[tuple[str, str], ...] = ()  # (blob, holder): bad at the holder, now removed
    error: str | None = None
    asked_bytes: int = 0  # the bytes of the distinct blobs it was asked for (held already or not)
    already: int = 0  # blobs it held before the pull
    adopted: bool = False  # it committed the step from the manifest the head gave, once all arrived
    seconds: float = 0.0

    _FIELDS = frozenset({"host", "pulled", "pulled_bytes", "failed", "bad_copies", "removed_bad_copies",
                         "asked_bytes", "already", "adopted", "seconds"})

    @property
    def failed_blobs(self) -> set[str]:
        return {b for b, _ in self.failed}

    @classmethod
    def unreachable(cls, host: str, cause: str) -> "PullResult":
        return cls(host=host, error=cause)

    def to_wire(self) -> dict:
        """The sidecar's answer to ``peer_pull`` (``mtc.sidecar.replication.pull_blobs``)."""
        if self.error is not None:
            raise ValueError(f"host {self.host}: a failed host's pull result is the head's note, not an answer")
        return {"host": self.host, "pulled": self.pulled, "pulled_bytes": self.pulled_bytes,
                "failed": [[b, [list(t) for t in causes]] for b, causes in self.failed],
                "bad_copies": [list(t) for t in self.bad_copies],
                "removed_bad_copies": [list(t) for t in self.removed_bad_copies],
                "asked_bytes": self.asked_bytes, "already": self.already, "adopted": self.adopted,
                "seconds": self.seconds}

    @classmethod
    def from_wire(cls, host: str, doc: Any) -> "PullResult":
        """Parse a sidecar's ``peer_pull`` answer (ProtocolError naming the host and the field)."""
        what = f"host {host}: malformed peer pull answer"
        if not isinstance(doc, dict):
            raise ProtocolError(f"{what} {doc!r:.200}")
        a = _decode(doc, _PullAnswer, what, cls._FIELDS)
        if a.host is not msgspec.UNSET and a.host != host:
            raise ProtocolError(f"{what}: it is that of host {a.host!r:.100}")
        return cls(host=host, pulled=a.pulled, pulled_bytes=a.pulled_bytes,
                   failed=tuple((b, tuple(causes)) for b, causes in a.failed),
                   bad_copies=tuple(a.bad_copies), removed_bad_copies=tuple(a.removed_bad_copies),
                   asked_bytes=a.asked_bytes, already=a.already, adopted=a.adopted, seconds=a.seconds)


_Count = Annotated[int, msgspec.Meta(ge=0)]


class _PullAnswer(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A ``peer_pull`` answer as it travels (``PullResult.to_wire``), decoded and checked in one call."""

    host: Any = msgspec.UNSET  # the host that answered: the one asked
    pulled: _Count = 0
    pulled_bytes: _Count = 0
    failed: list[tuple[str, list[tuple[str, str]]]] = []
    bad_copies: list[tuple[str, str, str]] = []
    removed_bad_copies: list[tuple[str, str]] = []
    asked_bytes: _Count = 0
    already: _Count = 0
    adopted: bool = False
    seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    WHY: ClassVar[dict[str, str]] = {
        **{k: f"{k!r} must be an integer >= 0" for k in ("pulled", "pulled_bytes", "asked_bytes", "already")},
        "adopted": "'adopted' must be true or false",
        "seconds": "'seconds' must be a number >= 0",
        "failed": "'failed' must be a list of [blob, [[holder, cause], ...]]",
        "bad_copies": "'bad_copies' must be a list of [text, text, text]",
        "removed_bad_copies": "'removed_bad_copies' must be a list of [text, text]",
    }


def _decode(doc: dict, cls: type, where: str, known: frozenset, joiner: str = ": ") -> Any:
    """``doc`` as the answer struct ``cls``, decoded and checked in one call; ProtocolError at ``where``
    in the field's own words (``cls.WHY``: ``where`` + ``joiner`` + them), or naming the fields this
    version does not know."""
    try:
        return msgspec.convert(doc, cls, strict=True)
    except msgspec.ValidationError as e:
        if str(e).startswith("Object contains unknown field") and _unknown(doc, known):
            raise ProtocolError(f"{where}: unknown fields {_unknown(doc, known)}; {_SAME_VERSION}") from None
        raise ProtocolError(f"{where}{joiner}{requests.refusal(str(e), doc, cls)}") from None


_HostId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class _HoldingAnswer(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One step of an inventory answer as it travels (``StepHolding.to_wire``)."""

    step: _Count
    blobs: _Count
    local_blobs: _Count
    step_blobs: _Count
    digest: str
    held: str
    manifest: str = ""
    part: bool = False
    own: str = ""
    copies: list[str] = []
    parts: list[_HostId] = []
    pieces: list[tuple[_HostId, _Count, str]] = []

    WHY: ClassVar[dict[str, str]] = {
        **{k: f"{k!r} must be an integer >= 0" for k in ("step", "blobs", "local_blobs", "step_blobs")},
        "manifest": "'manifest' is not a digest",
        "part": "'part' must be true or false",
        "own": "'own' or 'copies' is not a digest (list)",
        "copies": "'own' or 'copies' is not a digest (list)",
        "parts": "'parts' must list host ids",
        "pieces": "'pieces' must list [host id, blob count, bitmap]",
    }


class _PullNote(msgspec.Struct, gc=False):
    step: int
    error: str
    age_s: float


class _Room(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    free_bytes: _Count
    size_bytes: _Count


class _InventoryAnswer(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An inventory answer as it travels (``HostInventory.to_wire``), less its steps (each checked as a
    ``_HoldingAnswer``, so that a step's error names the step)."""

    host: Any = msgspec.UNSET
    steps: list[Any] = []
    damaged: list[int] = []
    pull_failures: list[_PullNote] = []
    ramdisk: _Room | None = None

    WHY: ClassVar[dict[str, str]] = {
        "damaged": "'damaged' is not a list of steps",
        "pull_failures": "'pull_failures' is not a list of {step, error, age_s}",
        "ramdisk": "'ramdisk' is not {free_bytes, size_bytes} (integers >= 0)",
    }
