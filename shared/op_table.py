"""What the head and the sidecars agree on about each sidecar operation, as plain data.

One row per operation: the type of its request (``mtc.shared.requests``: the head builds it,
the sidecar decodes and checks the arguments with it), whether it changes the host (fencing),
whether it runs as a job, whether it carries arrays (``data``: each transport moves them its own
way), the modes that serve it, the lane a cluster head sends it on, the class of timeout its
waits get and what one host's failure means to the head. ``mtc.sidecar.ops`` attaches to each
row what it calls on the sidecar service (and refuses to load if the two tables name different
operations); the cluster head picks its lane and timeout here (``mtc.head.dispatch.cluster``),
since ``mtc.head`` never imports ``mtc.sidecar``.
"""

from __future__ import annotations

import dataclasses

from mtc.shared import requests

MODES = ("colocated", "cluster")
LANES = ("control", "backup", "peer")  # a cluster head's connections per host (``HostLanes``)
# How long a cluster head waits on an operation's bytes (``Timeouts``): ``data``, as long as
# moving a host's share of a step; ``control``, short, so a hung host fails an inventory fast;
# ``backup`` and ``peer``, one job from start to end.
TIMEOUT_CLASSES = ("data", "control", "backup", "peer")
# What one host's failure means to the head (``Dispatcher``; both transports): "raise", the
# operation fails, naming the host; "skip", a host that cannot be reached is passed over (it is
# asked again when it is back), any other failure raised; "report", the host's answer says it
# (an inventory or a pull result with an ``error``); "next", another host is asked instead.
FAILURES = ("raise", "skip", "report", "next")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One operation's row (see the module's text)."""

    mutating: bool = False  # changes the host: only the head holding the lease may send it (fencing)
    long: bool = False  # runs as a job of the sidecar: answers {"job": id} at once, ``job`` tells its end
    data: bool = False  # carries arrays, which each transport moves its own way (not through ``ops.serve``)
    lane: str = "control"
    timeout: str = "control"
    modes: tuple[str, ...] = MODES
    why: str = ""  # why an operation is not in both modes
    failure: str = "raise"  # what one host's failure means to the head (``FAILURES``)
    # The type of its request (``mtc.shared.requests``): the head builds it, the sidecar decodes
    # and checks the arguments with it; ``colocated_request``, where colocated mode's differs.
    request: type[requests.Request] = requests.Empty
    colocated_request: type[requests.Request] | None = None

    def request_type(self, mode: str) -> type[requests.Request]:
        return self.colocated_request if mode == "colocated" and self.colocated_request else self.request

    def __post_init__(self):
        if (self.lane not in LANES or self.timeout not in TIMEOUT_CLASSES or not set(self.modes) <= set(MODES)
                or self.failure not in FAILURES):
            raise ValueError(f"bad operation row {self!r}: lane in {LANES}, timeout in {TIMEOUT_CLASSES}, "
                             f"modes in {MODES}, failure in {FAILURES}")


_BACKUP = dict(lane="backup", timeout="backup")
_PEER = dict(lane="peer", timeout="peer")

SPECS: dict[str, OpSpec] = {
    "ping": OpSpec(),
    "fingerprint": OpSpec(failure="skip"),
    "inventory": OpSpec(request=requests.Inventory, failure="report"),
    "manifest": OpSpec(request=requests.Manifest, failure="next"),
    "part": OpSpec(request=requests.StepRequest),
    "write": OpSpec(mutating=True, data=True, timeout="data", request=requests.Write),
    "read": OpSpec(data=True, timeout="data", request=requests.Read, colocated_request=requests.Load),
    "commit": OpSpec(mutating=True, timeout="data", request=requests.Commit),
    "abort": OpSpec(mutating=True, request=requests.StepRequest, failure="report"),  # best effort: logged
    "verify": OpSpec(request=requests.StepRequest, failure="report"),
    "lease": OpSpec(failure="skip"),
    # generation-checked by the lease itself (a newer head takes over)
    "claim": OpSpec(request=requests.Claim, failure="skip"),
    "configure": OpSpec(mutating=True, request=requests.Configure, failure="skip"),
    "job": OpSpec(request=requests.Job),  # polled on the lane of the job's operation (``HostLanes.run_job``)
    "backup_upload": OpSpec(mutating=True, long=True, request=requests.BackupUpload, **_BACKUP),
    "backup_finalize": OpSpec(mutating=True, request=requests.BackupFinalize, **_BACKUP),
    "backup_listing": OpSpec(request=requests.BackupListing, failure="next", **_BACKUP),
    "backup_manifest": OpSpec(request=requests.BackupManifest, failure="next", **_BACKUP),
    "backup_fetch": OpSpec(mutating=True, long=True, request=requests.BackupFetch, **_BACKUP),
    "peer_pull": OpSpec(mutating=True, long=True, request=requests.PeerPull, failure="report", **_PEER),
    # Not fenced: it writes only bytes that hash to the object's name, and marks only backups it found
    # bad, so `mtc verify --backup` may run it beside the head that drives the hosts.
    "backup_scrub": OpSpec(long=True, request=requests.BackupScrub, **_BACKUP),
    "close": OpSpec(modes=("colocated",), why="a daemon's service lives as long as its process: SIGTERM stops it"),
}

_UNKNOWN = OpSpec()


def spec(op: str) -> OpSpec:
    """The row of ``op``; an operation outside the table gets the control lane and timeout (the
    sidecar then refuses it, naming the operations it knows)."""
    return SPECS.get(op, _UNKNOWN)
