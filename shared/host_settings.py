"""The head's settings a sidecar follows, sent with ``configure`` (one path in both modes).

A head claims its hosts, then configures them: how many committed steps each keeps in RAM, the
backup root, how many backups to keep and the backup scrub's bandwidth cap. A sidecar holds no
other copy of these (none from its command line or from each request), so every host follows the
head that drives it now; a sidecar that restarts has none until the head configures it again (``NotConfiguredError`` until then).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mtc.shared.errors import ProtocolError


@dataclasses.dataclass(frozen=True)
class HostSettings:
    local_max_to_keep: int = 2  # committed steps each host keeps in its ramdisk
    backup_url: str | None = None  # the backup root (None: no backup tier)
    backup_max_to_keep: int = 2  # backups kept in the backup root
    backup_scrub_bytes_per_s: int = 50 * 2**20  # the scrub's bandwidth cap on this host (backup/scrub.py)

    @classmethod
    def from_config(cls, config: Any) -> "HostSettings":
        url = config.backup_root if config.base_output_directory else None
        if url is not None and "://" not in url:  # a local folder: as the head names it, wherever a host runs
            url = os.path.abspath(url)
        return cls(local_max_to_keep=int(config.local_max_to_keep), backup_url=url,
                   backup_max_to_keep=int(config.backup_max_to_keep),
                   backup_scrub_bytes_per_s=int(config.backup_scrub_bytes_per_s))

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, doc: Any) -> "HostSettings":
        """Settings from a ``configure`` request (ProtocolError naming the bad one)."""
        if not isinstance(doc, dict):
            raise ProtocolError("configure: 'settings' must be an object")
        unknown = set(doc) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ProtocolError(f"configure: unknown settings {sorted(unknown)}; run the same mtc version on "
                                "the head and every sidecar")
        for key in ("local_max_to_keep", "backup_max_to_keep", "backup_scrub_bytes_per_s"):
            v = doc.get(key, 1)
            if type(v) is not int or v < 1:
                raise ProtocolError(f"configure: {key} must be an integer >= 1, got {v!r:.50}")
        url = doc.get("backup_url")
        if url is not None and (not isinstance(url, str) or not url):
            raise ProtocolError("configure: backup_url must be a non-empty string or null")
        return cls(**doc)
