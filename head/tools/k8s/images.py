"""The image references of a rendered JobSet: the tags images/build.py gives (``<mtc>-python_X.Y-jax_X.Y.Z``),
the versions a tag carries, and the head and sidecar images a render uses (checked to match)."""

from __future__ import annotations

import json
import re

from mtc.shared.errors import ConfigError

from mtc.head.tools.k8s.options import (DAEMON_IMAGE_NAME, HEAD_IMAGE_NAME, SIDECAR_IMAGE_NAME,
                                             ManifestOptions)


def built_versions() -> dict:
    """{"mtc", "python", "jax"} of the images ``images/build.py`` builds: its lock's versions, which
    ``python images/build.py lock`` writes into ``image_versions.json`` (package data)."""
    from importlib import resources

    try:
        return json.loads(resources.files("mtc.head.tools.k8s").joinpath("image_versions.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"this mtc has no image_versions.json ({e}), so it cannot name the images that were "
                          "built; pass --image and --sidecar-image") from e


def image_tag(fp: dict | None = None) -> str:
    """``<mtc>-python_X.Y-jax_X.Y.Z``: the tag the build script gives every image (default: the
    versions of the images it builds, from its lock, not those of the environment this runs in).

    Pathways sidecar images carry python and jax in the tag the same way; head and sidecar
    must match exactly, and a tag that says so makes skew visible before anything runs.
    """
    fp = built_versions() if fp is None else fp
    return f"{fp['mtc']}-python_{fp['python']}-jax_{fp.get('jax') or 'none'}"


def _repository_name(ref: str) -> str:
    """The last path component of an image reference, without tag or digest:
    ``mtc-sidecar`` for ``registry:5000/p/mtc-sidecar:1.0@sha256:...``."""
    last = ref.split("@", 1)[0].rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


_TAG_VERSIONS = re.compile(r"-python_(\d+\.\d+)-jax_([0-9][0-9A-Za-z.]*)$")


def image_versions(ref: str) -> dict | None:
    """{"mtc", "python", "jax"} from an image reference's tag (``<mtc>-python_X.Y-jax_X.Y.Z``, as
    images/build.py tags every image; a Pathways sidecar tag ``<date>-python_X.Y-jax_X.Y.Z`` gives
    its date as "mtc"), or None when the tag does not carry them."""
    tag = ref.split("@", 1)[0].rsplit("/", 1)[-1].partition(":")[2]
    m = _TAG_VERSIONS.search(tag)
    if not m:
        return None
    return {"mtc": tag[: m.start()], "python": m[1], "jax": m[2]}


def image_mismatches(head: str, sidecar: str) -> list[tuple[str, str, str]]:
    """(what, head image's, sidecar image's) for each version the two tags disagree on.

    ConfigError when a tag does not carry its versions (nothing can be compared)."""
    hv, sv = image_versions(head), image_versions(sidecar)
    for ref, v in ((head, hv), (sidecar, sv)):
        if v is None:
            raise ConfigError(f"image {ref} has no <mtc>-python_X.Y-jax_X.Y.Z tag, so its versions cannot be "
                              "checked; use the tags images/build.py gives (python images/build.py tags)")
    return [(k, hv[k], sv[k]) for k in ("mtc", "python", "jax") if hv[k] != sv[k]]


def job_images(o: ManifestOptions) -> tuple[str, str]:
    """Head and sidecar image references; both default to the images the build script builds (its lock)."""
    tag = image_tag()
    prefix = o.image_registry.rstrip("/") + "/" if o.image_registry else ""
    head = o.image or f"{prefix}{HEAD_IMAGE_NAME}:{tag}"
    sidecar = o.sidecar_image or f"{prefix}{SIDECAR_IMAGE_NAME}:{tag}"
    for flag, ref, name in (("--image", head, HEAD_IMAGE_NAME),
                            ("--sidecar-image", sidecar, SIDECAR_IMAGE_NAME)):
        if not ref.strip() or any(c.isspace() for c in ref):
            raise ConfigError(f"{flag}={ref!r} is not an image reference (e.g. registry/{name}:{tag})")
    if _repository_name(sidecar) == DAEMON_IMAGE_NAME:
        path, _, last = sidecar.split("@", 1)[0].rpartition("/")
        fixed = (path + "/" if path else "") + SIDECAR_IMAGE_NAME + last[len(DAEMON_IMAGE_NAME):]
        raise ConfigError(
            f"--sidecar-image (--pathways-colocated-python-sidecar-image) is {sidecar}, the cluster-mode sidecar "
            f"daemon image (python -m mtc.sidecar serve), which does not run the Pathways colocated Python "
            f"server; use the colocated sidecar image, e.g. {fixed} (python images/build.py build "
            "--colocated-base <pathways-colocated-python/sidecar image>), or drop the flag for the default "
            f"[--image-registry/]{SIDECAR_IMAGE_NAME}:<tag>")
    if image_versions(head) and image_versions(sidecar):  # the same check as `mtc images check`
        bad = image_mismatches(head, sidecar)
        if bad:
            raise ConfigError("--image and --sidecar-image differ: " + "; ".join(
                f"{k}: head {h}, sidecar {v}" for k, h, v in bad) + "; head and sidecar must run exactly the same "
                "mtc, python and jax: use images built together (same tag)")
    return head, sidecar
