"""The head gives hosts a step's manifest: an empty ``peer_pull`` with the manifest makes a host adopt it.

Two callers: hosts whose copy of a step manifest is damaged get the version the others agree on
back (so that their blobs count again), and a reader (an export) gives the manifest to hosts that
hold only a commit record of the step, whose keepers (the hosts that keep the whole manifest) may
be gone with a stopped job.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from mtc.shared import format as fmt
from mtc.shared.errors import MTCError

log = logging.getLogger(__name__)


def give(dispatch: Any, step: int, manifest: fmt.StepManifest, hosts: Iterable[str]) -> dict[str, str | None]:
    """host -> None when it took ``manifest`` of ``step``, else why not."""
    hosts = sorted(hosts)
    if not hosts:
        return {}
    return {h: res.error or None for h, res in dispatch.peer_pull(step, {h: [] for h in hosts}, manifest).items()}


def repair_damaged(dispatch: Any, inv: Any) -> bool:
    """Hosts whose copy of a step manifest is damaged get the version the others agree on back.
    Only steps newer than the newest restorable one, and only from a copy that passes its checks.
    Whether any host got one."""
    newest = max(inv.restorable, default=-1)
    repaired = False
    for step in sorted({s for steps in inv.damaged.values() for s in steps if s > newest}, reverse=True):
        view = inv.views.get(step)
        if view is None or not view.manifest:
            continue
        try:
            manifest = dispatch.manifest(step, view.manifest)
        except MTCError:
            continue
        for h, error in give(dispatch, step, manifest, [h for h, steps in inv.damaged.items() if step in steps]).items():
            if error:
                log.warning("step %d: could not give host %s its manifest back: %s", step, h, error)
            else:
                log.warning("step %d: host %s had a damaged copy of its manifest; gave it back", step, h)
                repaired = True
    return repaired
