"""Version pinning between the head and the sidecars (README, "Images").

The head compares its fingerprint with every sidecar's before the first save or restore and
refuses to go on when something that must match does not.
"""

from __future__ import annotations

import importlib.metadata
import sys

from mtc.shared.errors import VersionMismatchError

MTC_VERSION = "0.1.0"
# Bumped whenever a message or on-disk format changes incompatibly.
PROTOCOL_VERSION = 1

# Packages whose versions must be equal on both sides (exactly).
EXACT = ("jax", "jaxlib", "mtc")
# Packages whose major.minor must be equal (pickling and array layout compatibility).
MINOR = ("numpy", "cloudpickle", "ml_dtypes", "orbax-checkpoint")


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fingerprint() -> dict:
    """This process's versions of everything that must agree across the head/sidecar seam."""
    fp = {
        "mtc": MTC_VERSION,
        "protocol": PROTOCOL_VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    for name in EXACT + MINOR:
        if name == "mtc":
            continue
        fp[name] = _pkg_version(name)
    return fp


def _minor(v: str | None) -> str | None:
    return None if v is None else ".".join(v.split(".")[:2])


def mismatches(head: dict, sidecar: dict) -> list[tuple[str, str | None, str | None]]:
    """The (package, head version, sidecar version) triples that do not agree."""
    out = []
    for key in ("mtc", "protocol", "python") + EXACT:
        if key in ("mtc",) and key in out:
            continue
        if head.get(key) != sidecar.get(key):
            out.append((key, head.get(key), sidecar.get(key)))
    for key in MINOR:
        if _minor(head.get(key)) != _minor(sidecar.get(key)):
            out.append((key, head.get(key), sidecar.get(key)))
    seen, unique = set(), []
    for row in out:
        if row[0] not in seen:
            seen.add(row[0])
            unique.append(row)
    return unique


def check_fingerprints(head: dict, sidecars: dict[str, dict]) -> None:
    """Raise VersionMismatchError listing every mismatch on every host, or return."""
    lines = []
    for host, fp in sorted(sidecars.items()):
        for pkg, hv, sv in mismatches(head, fp):
            lines.append(f"  {pkg}: head {hv}, sidecar {sv} (host {host})")
    if lines:
        raise VersionMismatchError(
            "head and sidecar versions differ; rebuild both images from the same lock file "
            "(python images/build.py build) so they match:\n" + "\n".join(lines)
        )
