"""A backup's part index: how one host reads the header and its own part of a backup manifest,
each checked, without the other hosts' parts.

A step manifest (``mtc/3``) is a header line and one line per host part; the header holds each
part's length and xxh3-128 (not a cryptographic hash). At thousands of hosts the whole manifest is
hundreds of MiB, and a restore from the backup onto the topology that saved the step needs, on each
host, only the header and that host's part. So a finalize writes beside the manifest
``backups/<name>.parts``::

    {"format": "mtc-backup-parts/1", "backup": name, "step": step, "digest": the header's digest,
     "header": {"bytes": n, "sha256": hex}, "parts": [SHA-256 of each part, in the header's order]}

and the seal names it (``Seals.check_index``): its SHA-256 and a tag of its own. A reader checks the
index against the seal, reads the header by range and checks it against the index (then against
its own digest), reads its part at the offset the header's lengths give and checks that against the
index: every byte it uses is covered by a cryptographic hash the job key signed. A backup without an
index (an older version's, a manifest of an older format) is read whole (``read`` returns None).
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from mtc.shared import backup_layout as layout
from mtc.shared.backup_seals import Seals
from mtc.shared.errors import ManifestError
from mtc.shared.format.base import load_json
from mtc.shared.objstore.store import ObjectNotFoundError, ObjectStore
from mtc.shared.safe_files import MAX_MANIFEST_BYTES

FORMAT = "mtc-backup-parts/1"
MAX_INDEX_BYTES = 32 << 20  # 67 bytes a part: about 500,000 hosts
_STEP_FORMAT = b'"format":"mtc/3"'


def make(name: str, manifest_json: bytes) -> bytes | None:
    """The part index of backup ``name`` holding ``manifest_json``; None for a manifest that has no
    parts (a format older than ``mtc/3``)."""
    data = bytes(manifest_json)
    header, _, rest = data.partition(b"\n")
    if _STEP_FORMAT not in header:
        return None
    doc = load_json(header, f"backup {name} manifest header")
    if doc.get("format") != "mtc/3":
        return None
    parts = rest.split(b"\n") if rest else []
    return json.dumps({"format": FORMAT, "backup": name, "step": doc.get("step"), "digest": doc.get("digest"),
                       "header": {"bytes": len(header), "sha256": hashlib.sha256(header).hexdigest()},
                       "parts": [hashlib.sha256(p).hexdigest() for p in parts]},
                      sort_keys=True, separators=(",", ":")).encode()


def read(store: ObjectStore, seals: Seals, name: str, hosts: Sequence[str] = ()) -> tuple[bytes, dict[str, bytes]] | None:
    """(the header line, host -> its part) of backup ``name``'s manifest for each of ``hosts``, every
    piece checked against the sealed index (no hosts: the header alone). None when the backup has no
    index its seal names (read the manifest whole then). ManifestError when a piece fails its check,
    or when the manifest has no part of one of ``hosts``."""
    where = f"backup {name} in {store.url}"
    try:
        data = store.get_bytes(layout.parts_object(name), max_bytes=MAX_INDEX_BYTES)
    except ObjectNotFoundError:
        return None
    if not seals.check_index(name, data):
        return None
    index = load_json(data, f"{where}: part index")
    step = layout.parse_backup_name(name)
    head, shas = index.get("header"), index.get("parts")
    if (index.get("format") != FORMAT or index.get("backup") != name or index.get("step") != step
            or not isinstance(head, dict) or not isinstance(head.get("bytes"), int)
            or not 0 < head["bytes"] <= MAX_MANIFEST_BYTES or not isinstance(head.get("sha256"), str)
            or not isinstance(shas, list) or not all(isinstance(s, str) for s in shas)):
        raise ManifestError(f"{where}: its part index is malformed or names another backup; it is not restored "
                            "from its parts")
    manifest = layout.manifest_object(name)
    header = store.get_range(manifest, 0, head["bytes"])
    if len(header) != head["bytes"] or hashlib.sha256(header).hexdigest() != head["sha256"]:
        raise ManifestError(f"{where}: its manifest's header is not the one its part index names (changed after it "
                            "was written); it is not restored")
    if not hosts:
        return header, {}
    metas = load_json(header, f"{where}: manifest header").get("parts")
    if not isinstance(metas, list) or len(metas) != len(shas) or not all(
            isinstance(m, dict) and isinstance(m.get("bytes"), int) and m["bytes"] >= 0 for m in metas):
        raise ManifestError(f"{where}: its manifest's header lists {len(metas) if isinstance(metas, list) else 'no'} "
                            f"parts, its part index {len(shas)}; it is not restored from its parts")
    at: dict[str, tuple[int, int, str]] = {}  # host -> (offset, bytes, sha256)
    offset = len(header) + 1
    for meta, sha in zip(metas, shas):
        at.setdefault(meta.get("host"), (offset, meta["bytes"], sha))
        offset += meta["bytes"] + 1
    out = {}
    for host in hosts:
        if host not in at:
            raise ManifestError(f"{where}: its manifest has no part of host {host}")
        offset, size, sha = at[host]
        part = store.get_range(manifest, offset, size)
        if len(part) != size or hashlib.sha256(part).hexdigest() != sha:
            raise ManifestError(f"{where}: the part of host {host} is not the one its part index names (changed "
                                "after it was written); it is not restored")
        out[host] = part
    return header, out
