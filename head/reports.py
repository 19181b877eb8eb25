"""What the manager reports (frozen values), and the inventory snapshot a restore plans on."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """What one save did: sizes, blob counts and the time of each phase (seconds).

    ``bytes_total`` is the state's size (every array once); ``bytes_written`` what the hosts
    wrote (less than their shares when blobs were unchanged); ``blobs_total`` the blobs the
    hosts hold for the step, each host's counted (data-parallel twins count once per host).
    ``twin_mismatches``: boxes whose data-parallel replicas held different bytes
    (``mtc.head.twin_check.TwinMismatch``, each naming the array, the box and the hosts and devices
    of every copy); such a step is not committed (``committed`` false, ``twin_check=warn``).
    """

    step: int
    bytes_total: int = 0
    bytes_written: int = 0
    blobs_total: int = 0
    hosts: int = 0
    waited_for_previous_s: float = 0.0
    blocked_s: float = 0.0  # time save() kept the caller (mostly the device-to-host copy)
    stage_s: float = 0.0
    phase1_s: float = 0.0
    phase2_s: float = 0.0
    total_s: float = 0.0
    committed: bool = True
    twin_mismatches: tuple = ()

    @classmethod
    def of_commit(cls, step: int, leaves: list, committed: dict, **times: float) -> "SaveReport":
        """The report of a committed save: sizes from the leaves, counts from the hosts' commit
        answers (host -> {"written_bytes", "blobs"}), and the phases' ``times``."""
        return cls(step=step, bytes_total=sum(leaf.nbytes for leaf in leaves),
                   bytes_written=sum(h.get("written_bytes", 0) for h in committed.values()),
                   blobs_total=sum(h.get("blobs", 0) for h in committed.values()), hosts=len(committed), **times)


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """What one restore did: bytes and blobs by tier, and the time of each phase (seconds)."""

    step: int
    bytes_by_tier: dict = dataclasses.field(default_factory=dict)  # "ram", "peer", "backup"
    blobs_by_tier: dict = dataclasses.field(default_factory=dict)
    source: str = "cluster"  # "cluster", or the name of the backup restored
    skipped_copies: tuple = ()  # "host <- holder: blob: why" for each bad or unreachable copy passed over
    inventory_s: float = 0.0
    pull_s: float = 0.0  # hosts pulling what they lacked from peers (and the backup)
    load_s: float = 0.0
    total_s: float = 0.0
    prefetched: bool = False  # the start-up pull had brought this step's missing blobs (counted above)


@dataclasses.dataclass(frozen=True)
class PrefetchReport:
    """What the start-up pull did: the newest restorable step, brought local in its saved layout."""

    step: int
    source: str = "cluster"  # "cluster", or the name of the backup it came from
    bytes_by_tier: dict = dataclasses.field(default_factory=dict)  # "peer", "backup": bytes pulled
    blobs_by_tier: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class ReplicationReport:
    """What the replication of one step did (the peer tier), or why it is not complete."""

    step: int
    planned_blobs: int = 0  # copies the first plan asked for
    planned_bytes: int = 0
    moved_blobs: int = 0  # copies made, over every attempt
    moved_bytes: int = 0
    bad_copies: int = 0  # received copies that failed their hash (skipped for another holder)
    removed_bad_copies: int = 0  # ... that were corrupt at their holder, which removed them (then re-copied)
    complete: bool = False  # every planned copy was made (nothing left to retry)
    replicated: bool = False  # every blob is on >= replication_factor slices (hosts with one slice)
    attempts: int = 0
    error: str | None = None
    seconds: float = 0.0
    # From a wait that ran out of time (``wait_for_replication(timeout=...)``): the replication goes on
    # in the background, and ``error`` says which steps and hosts are short of copies and why.
    in_progress: bool = False
    short_of_copies: dict = dataclasses.field(default_factory=dict)  # host -> why it lacks copies (last attempt)


@dataclasses.dataclass(frozen=True)
class StepStatus:
    """One step as the inventories see it."""

    step: int
    restorable: bool  # every blob has a copy on some host (and every host answered)
    replicated: bool  # every blob on >= replication_factor slices (hosts with one slice)
    min_copies: int  # fewest slices (hosts) holding any one blob of the step
    hosts: tuple = ()  # hosts with the step committed
    replicating: bool = False  # this head's replication of the step is running (retrying) in the background
    short_of_copies: dict = dataclasses.field(default_factory=dict)  # host -> why it lacks copies (last attempt)


@dataclasses.dataclass(frozen=True)
class BackupReport:
    """What one backup did, or why it did not run."""

    step: int
    name: str | None = None
    uploaded_bytes: int = 0
    uploaded_blobs: int = 0
    skipped_blobs: int = 0  # already in the store (incremental backups)
    bytes_by_host: dict = dataclasses.field(default_factory=dict)
    skipped_because_running: int = 0  # due backups skipped while this one ran
    error: str | None = None
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Inventory:
    """One look at the hosts (and the backup root): what each step's blobs have where.

    A value, passed from the step choice to the planning of the same restore, so that two
    threads (the start-up pull and a restore) never read each other's answers.
    """

    views: dict  # step -> StepView (mtc.head.replication.plan)
    unreachable: dict  # host -> why it could not be asked
    backup_unreachable: str | None = None  # why the backup root could not be listed
    damaged: dict = dataclasses.field(default_factory=dict)  # host -> steps whose manifest copy is damaged there

    @property
    def restorable(self) -> list[int]:
        """Steps whose every blob has a copy on some host, ascending; none while a host cannot be
        asked (the restore would need that host)."""
        if self.unreachable:
            return []
        return sorted(s for s, v in self.views.items() if v.restorable)

    def note(self) -> str:
        """What an error about a missing step should add: hosts and the backup root not asked."""
        note = ""
        if self.unreachable:
            note = ("; hosts that could not be asked, so no step is confirmed on them: "
                    + "; ".join(f"{h} ({e})" for h, e in sorted(self.unreachable.items())))
        if self.backup_unreachable:
            note += f"; the backup root could not be listed ({self.backup_unreachable})"
        return note


class Pulled:
    """Bytes and blobs a restore brought from the peer and backup tiers, and copies it skipped."""

    def __init__(self) -> None:
        self.bytes = {"peer": 0, "backup": 0}
        self.blobs = {"peer": 0, "backup": 0}
        self.skipped: list[str] = []
        self.fetched: dict[str, list[str]] = {}  # host -> blobs it now holds that it lacked
        self.bad: dict[str, list[str]] = {}  # blob -> "holder: why" for copies found bad (and removed) this restore

    def add(self, tier: str, nbytes: int, nblobs: int) -> None:
        self.bytes[tier] += nbytes
        self.blobs[tier] += nblobs

    def got(self, host: str, blobs: list[str]) -> None:
        self.fetched.setdefault(host, []).extend(blobs)

    def add_backup(self, fetched: dict[str, dict]) -> None:
        self.add("backup", sum(f.get("downloaded_bytes", 0) for f in fetched.values()),
                 sum(f.get("downloaded", 0) for f in fetched.values()))
