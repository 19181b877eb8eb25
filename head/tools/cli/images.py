"""``mtc images check HEAD SIDECAR [--engine ENGINE]``: the versions two images carry, in their tags
(and with ``--engine``, in their labels), compared."""

from __future__ import annotations

import argparse
import json
import sys

from mtc.shared.errors import ConfigError

from mtc.head.tools.cli.common import last_line


_LABELS = (("mtc", "mtc.version"), ("protocol", "mtc.protocol"), ("python", "mtc.python"), ("jax", "mtc.jax"),
           ("jaxlib", "mtc.jaxlib"))


def _image_labels(engine: str, ref: str) -> dict[str, str]:
    """The labels of image ``ref`` in ``engine``'s local storage; ConfigError when it cannot say."""
    import shutil
    import subprocess

    if shutil.which(engine) is None:
        raise ConfigError(f"--engine {engine}: {engine} is not installed here; drop --engine to compare the tags only")
    try:
        out = subprocess.run([engine, "image", "inspect", ref], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{engine} image inspect {ref} did not answer in 120 s") from None
    if out.returncode != 0:
        try:
            answers = subprocess.run([engine, "info"], capture_output=True, timeout=60).returncode == 0
        except subprocess.TimeoutExpired:
            answers = False
        if not answers:
            raise ConfigError(f"--engine {engine}: {engine} does not answer here ({last_line(Exception(out.stderr))});"
                              " start its engine, or drop --engine to compare the tags only")
        raise ConfigError(f"{engine} has no image {ref} ({last_line(Exception(out.stderr))}); pull or build it "
                          "first (python images/build.py build), or drop --engine to compare the tags only")
    try:
        doc = json.loads(out.stdout)[0]
    except (ValueError, IndexError, KeyError) as e:
        raise ConfigError(f"{engine} image inspect {ref} gave no JSON ({e})") from None
    return (doc.get("Config") or {}).get("Labels") or doc.get("Labels") or {}


def cmd_images_check(args: argparse.Namespace) -> int:
    from mtc.head.tools.k8s import images

    try:
        bad = images.image_mismatches(args.head_image, args.sidecar_image)
        labels = ({role: _image_labels(args.engine, ref) for role, ref in
                   (("head", args.head_image), ("sidecar", args.sidecar_image))} if args.engine else None)
    except ConfigError as e:
        print(f"mtc images check: error: {e}", file=sys.stderr)
        return 2
    hv, sv = images.image_versions(args.head_image), images.image_versions(args.sidecar_image)
    print(f"{'':8} {'head':24} {'sidecar':24}")
    for k in ("mtc", "python", "jax"):
        mark = "  <- differs" if hv[k] != sv[k] else ""
        print(f"{k:8} {hv[k]:24} {sv[k]:24}{mark}")
    problems = []
    if bad:
        problems.append("the head and sidecar images differ (" + ", ".join(k for k, _, _ in bad) + "); build both "
                        "from the same lock (python images/build.py build) and use the same tag")
    if labels is not None:
        print(f"labels ({args.engine}):")
        for k, label in _LABELS:
            h, s = labels["head"].get(label, "-"), labels["sidecar"].get(label, "-")
            print(f"{k:8} {h:24} {s:24}{'  <- differs' if h != s else ''}")
        differ = [k for k, label in _LABELS if labels["head"].get(label) != labels["sidecar"].get(label)]
        if differ:
            problems.append(f"the images' labels differ ({', '.join(differ)}): they were built from different locks")
        missing = [f"{role} {label}" for role in labels for _, label in _LABELS if label not in labels[role]]
        if missing:
            problems.append(f"labels missing ({', '.join(missing)}): build the images with python images/build.py "
                            "build")
        for role, ref, tagged in (("head", args.head_image, hv), ("sidecar", args.sidecar_image, sv)):
            lied = [f"{k}: tag {tagged[k]}, label {labels[role].get(label)}" for k, label in _LABELS
                    if k in tagged and label in labels[role] and labels[role][label] != tagged[k]]
            if lied:
                problems.append(f"the {role} image {ref} is tagged with other versions than its labels say ("
                                + "; ".join(lied) + "): retag it with python images/build.py tags")
    if problems:
        for p in problems:
            print(f"mtc images check: {p}", file=sys.stderr)
        return 1
    print("ok: the images carry the same mtc, python and jax" + (" (tags and labels)" if labels else ""))
    return 0
