"""Build the head and sidecar images from one lock file (README, "Images").

The head refuses to run against sidecars whose jax/jaxlib/python/mtc differ from its own
(``mtc.shared.version``). This script makes that refusal rare: every image installs the same
``images/requirements.lock``, and is tagged and labelled with the versions read from that
lock, never from whatever interpreter runs the script. ``mtc-head`` and ``mtc-sidecar`` (the
cluster-mode daemon) share one base image; ``mtc-colocated-sidecar`` (colocated mode on
Pathways, what ``mtc manifests render`` runs on the workers) is built on Google's colocated
Python sidecar image (``--colocated-base``), whose tag must carry the lock's python and jax.

    python images/build.py lock [--check]            # re-resolve requirements.lock (uv pip compile), or repeat it
    python images/build.py tags [--registry R]       # the three image references
    python images/build.py build [--registry R] [--colocated-base IMAGE] [--engine podman] [--dry-run]
    python images/build.py check [--lock FILE]       # lock, Dockerfiles and this environment agree

Runs with any Python >= 3.11 (tomllib); ``lock`` needs uv (``pip install uv``), and only ``check``
needs mtc installed (it compares with ``mtc.shared.version.fingerprint()``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

IMAGES = Path(__file__).resolve().parent
REPO = IMAGES.parent
LOCK = IMAGES / "requirements.lock"
# role -> Dockerfile; the image is mtc-<role>. "sidecar" is the cluster-mode daemon
# (`python -m mtc.sidecar serve`); "colocated-sidecar" is Google's Pathways colocated Python
# server with mtc installed into it (colocated mode, the one `mtc manifests render` uses).
COLOCATED = "colocated-sidecar"
DOCKERFILES = {"head": IMAGES / "Dockerfile.head", "sidecar": IMAGES / "Dockerfile.sidecar",
               COLOCATED: IMAGES / "Dockerfile.colocated"}
# The colocated Python server ships only in these images (not on PyPI); the tag's
# -python_X.Y-jax_X.Y.Z must equal the lock's.
COLOCATED_BASE_EXAMPLE = ("us-docker.pkg.dev/cloud-tpu-v2-images/pathways-colocated-python/sidecar:"
                          "<date>-python_{python}-jax_{jax}")
DIST = IMAGES / "dist"  # the mtc wheel goes here; "dist/" is git-ignored

# The base image of mtc-head and mtc-sidecar, pinned by tag. Its Python minor is the lock's Python and
# its glibc (Debian bookworm: 2.36) bounds the manylinux wheels the lock may pick.
BASE_IMAGE = "python:3.12.12-slim-bookworm"
GLIBC = (2, 36)
ARCH = "x86_64"  # TPU and GPU hosts of Pathways are x86_64; the lock has hashes for one platform

# Extras of mtc the images install: the backup tier (sidecar) and the head's bucket listing use
# GCS. Not "bench" (orbax-checkpoint): neither image imports orbax; the fingerprint tolerates its
# absence on both sides (None == None), and it would pull tensorstore and ~300 MB into each image.
EXTRAS = ("gcs",)

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH = re.compile(r"--hash=(sha256:[0-9a-f]{64})")


def normalize(name: str) -> str:
    """PEP 503 name, so that ``ml_dtypes``, ``ml-dtypes`` and ``ML.dtypes`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class Lock:
    """What ``requirements.lock`` says: its header fields and its exact pins (with hashes)."""

    header: dict[str, str]
    pins: dict[str, str]  # normalized name -> version
    hashes: dict[str, tuple[str, ...]]

    @property
    def python(self) -> str:
        return self.header["python"]

    @property
    def mtc(self) -> str:
        return self.header["mtc"]

    @property
    def jax(self) -> str:
        return self.pins["jax"]


def parse_lock(text: str) -> Lock:
    """Parse lock text: ``# key: value`` header lines, then ``name==version \\ --hash=...`` entries.

    Raises ValueError naming the line when something is not an exact pin, or when a field the
    tags need (python, mtc, the jax pin) is missing: a lock that cannot say what it installs is
    no lock.
    """
    header: dict[str, str] = {}
    pins: dict[str, str] = {}
    hashes: dict[str, tuple[str, ...]] = {}
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            m = re.match(r"#\s*([a-z][a-z0-9-]*):\s*(.*)$", line)
            if m and not pins:
                header[m.group(1)] = m.group(2).strip()
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            logical.append(buf.strip())
        buf = ""
    if buf.strip():
        logical.append(buf.strip())
    for entry in logical:
        m = _PIN.match(entry)
        if not m:
            raise ValueError(f"lock entry is not an exact pin (name==version): {entry!r}")
        name = normalize(m.group(1))
        pins[name] = m.group(2)
        hashes[name] = tuple(_HASH.findall(entry))
    for key in ("python", "mtc"):
        if key not in header:
            raise ValueError(f"lock header has no '# {key}: ...' line")
    if "jax" not in pins:
        raise ValueError("lock does not pin jax")
    return Lock(header, pins, hashes)


def read_lock(path: Path = LOCK) -> Lock:
    """Parse the lock file at ``path``."""
    return parse_lock(path.read_text())


def tag(lock: Lock) -> str:
    """The image tag every image carries: ``<mtc>-python_<X.Y>-jax_<X.Y.Z>``.

    The ``python_X.Y-jax_X.Y.Z`` part follows the Pathways colocated Python sidecar tags
    (e.g. ``2025_10_29-python_3.10-jax_0.6.2``), so a glance at a manifest shows whether head
    and sidecar can agree.
    """
    return f"{lock.mtc}-python_{lock.python}-jax_{lock.jax}"


def image_refs(lock: Lock, registry: str = "") -> dict[str, str]:
    """``{"head": ref, "sidecar": ref, "colocated-sidecar": ref}``: the same tag on each image name."""
    prefix = registry.rstrip("/") + "/" if registry else ""
    return {role: f"{prefix}mtc-{role}:{tag(lock)}" for role in DOCKERFILES}


def build_args(lock: Lock, lock_text: str) -> dict[str, str]:
    """The ``--build-arg`` values: the Dockerfiles label the image with them and verify, inside
    the image, that what pip installed reports exactly these versions."""
    return {
        "BASE_IMAGE": lock.header.get("base-image", BASE_IMAGE),
        "MTC_VERSION": lock.mtc,
        "MTC_PROTOCOL": lock.header.get("protocol", ""),
        "PYTHON_VERSION": lock.python,
        "JAX_VERSION": lock.jax,
        "JAXLIB_VERSION": lock.pins.get("jaxlib", ""),
        "LOCK_SHA256": hashlib.sha256(lock_text.encode()).hexdigest(),
    }


def colocated_base_problem(lock: Lock, base: str) -> str | None:
    """Why ``base`` cannot be the colocated sidecar's base for ``lock``, or None when it can.

    The colocated Python server in the base was built against the base's python and jax; the
    lock must not swap them, and the head must run exactly the same ones. So the base's tag
    must end in the lock's ``-python_X.Y-jax_X.Y.Z`` (a ``@sha256:...`` digest may follow).
    """
    want = f"-python_{lock.python}-jax_{lock.jax}"
    example = COLOCATED_BASE_EXAMPLE.format(python=lock.python, jax=lock.jax)
    name = base.strip().split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if not base.strip() or any(c.isspace() for c in base.strip()):
        return f"--colocated-base={base!r} is not an image reference; give e.g. {example}"
    tag_ = last.split(":", 1)[1] if ":" in last else ""
    m = re.search(r"(?:^|-)python_(\d+\.\d+)-jax_([0-9][0-9A-Za-z.]*)$", tag_)
    if not m:
        return (f"--colocated-base={base} has no -python_X.Y-jax_X.Y.Z at the end of its tag, so its "
                f"versions cannot be checked against the lock ({want[1:]}); give the Pathways colocated "
                f"Python sidecar tag, e.g. {example}")
    if (m.group(1), m.group(2)) != (lock.python, lock.jax):
        return (f"--colocated-base={base} is python {m.group(1)}, jax {m.group(2)}, but "
                f"images/requirements.lock is python {lock.python}, jax {lock.jax} (the head runs the "
                f"lock's); use the colocated sidecar tag ending {want}, e.g. {example}, or re-lock for "
                f"the base (Python {m.group(1)} in BASE_IMAGE of images/build.py, jax=={m.group(2)} in "
                "pyproject.toml, then python images/build.py lock)")
    return None


def docker_commands(lock: Lock, lock_text: str, registry: str = "",
                    revision: str | None = None, colocated_base: str = "", *, engine: str = "docker",
                    base: str = "", context: str | None = None,
                    options: Sequence[str] = ()) -> list[list[str]]:
    """One ``<engine> build`` command per image, run from the repository root with ``images/``
    (or ``context``) as the context: it holds the lock and ``dist/`` with the wheel, nothing else
    is sent. ``base`` replaces the lock's base image of mtc-head and mtc-sidecar (a local image
    with the same Python minor, say); the colocated sidecar is built on ``colocated_base``, and
    left out without one. ``options`` go to every build command as they are."""
    refs = image_refs(lock, registry)
    cmds = []
    for role, dockerfile in DOCKERFILES.items():
        args = build_args(lock, lock_text)
        if role == COLOCATED:
            if not colocated_base:
                continue
            args["BASE_IMAGE"] = colocated_base
        elif base:
            args["BASE_IMAGE"] = base
        cmd = [engine, "build", "--platform", f"linux/{'amd64' if ARCH == 'x86_64' else ARCH}",
               "--file", str(dockerfile.relative_to(REPO)), "--tag", refs[role], *options]
        for key, value in args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if revision:
            cmd += ["--label", f"org.opencontainers.image.revision={revision}"]
        cmd.append(context or str(IMAGES.relative_to(REPO)))
        cmds.append(cmd)
    return cmds


def dockerfile_arg_default(text: str, name: str) -> str | None:
    """The default of ``ARG name=value`` in a Dockerfile, or None when it has none."""
    m = re.search(rf"^ARG\s+{re.escape(name)}=(\S+)\s*$", text, re.MULTILINE)
    return m.group(1).strip("\"'") if m else None


def python_minor_of_image(image: str) -> str | None:
    """``3.11`` for ``python:3.11.14-slim-bookworm``; None when the tag does not say."""
    m = re.search(r":(\d+)\.(\d+)", image)
    return f"{m.group(1)}.{m.group(2)}" if m else None


# ----------------------------------------------------------------------------- project facts

def project() -> dict:
    """``[project]`` of pyproject.toml."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def runtime_requirements() -> list[str]:
    """What the images need of PyPI: mtc's dependencies plus the extras in EXTRAS."""
    proj = project()
    reqs = list(proj["dependencies"])
    for extra in EXTRAS:
        reqs += proj["optional-dependencies"][extra]
    return reqs


def requirement_name(req: str) -> str:
    """The normalized package name of a requirement string such as ``jax[tpu]>=0.6``."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"cannot read a package name from requirement {req!r}")
    return normalize(m.group(1))


def protocol_version() -> str:
    """``PROTOCOL_VERSION`` from shared/version.py, read without importing mtc."""
    tree = ast.parse((REPO / "shared" / "version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "PROTOCOL_VERSION" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise ValueError("shared/version.py defines no PROTOCOL_VERSION")


def platforms(glibc: tuple[int, int] = GLIBC, arch: str = ARCH) -> list[str]:
    """pip ``--platform`` values the base image accepts, most specific first (pip's preference
    order), since pip does not expand ``manylinux_2_36`` to the older glibc tags by itself."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


# ----------------------------------------------------------------------------- subcommands

def uv_command() -> list[str]:
    """How to run uv: ``$MTC_UV``, else ``uv`` on PATH, else ``python -m uv`` (pip install uv)."""
    if os.environ.get("MTC_UV"):
        return shlex.split(os.environ["MTC_UV"])
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if found:
        return [found]
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv"]
    raise LockError("the lock is resolved with uv, which is not installed: pip install uv (or set MTC_UV)")


class LockError(RuntimeError):
    """The lock cannot be resolved or checked (uv missing, resolution failed)."""


def utc_now() -> str:
    """Now, to the second, in the form the lock header records (``2026-12-01T10:30:00Z``)."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def resolve(requirements: Sequence[str], python: str, exclude_newer: str,
            pinned: dict[str, str] | None = None) -> str:
    """uv's lock text (exact pins, every file's sha256) for ``requirements`` on the image platform.

    uv resolves for a target that need not be the interpreter running this (``--python-version``,
    ``--python-platform``: markers are evaluated for the image, not for here), only from wheels
    (the images install with ``--only-binary=:all:``), and only from files uploaded before
    ``exclude_newer``: the same requirements and date give the same lock on any machine, which is
    what ``lock --check`` proves. No uv or pip configuration of this machine is read, and no cached
    index page (``--refresh``: a stale one once gave an older ml-dtypes than the index held).

    ``pinned`` (name -> version): constraints the resolution must keep (``lock --check`` passes the
    lock's own pins: a release the index lists later with an older upload date, which has happened,
    does not make a good lock fail its check).
    """
    cmd = uv_command() + [
        "pip", "compile", "-", "--quiet", "--no-config", "--refresh", "--no-header", "--no-annotate", "--generate-hashes",
        "--only-binary", ":all:", "--python-version", python,
        "--python-platform", f"{ARCH}-manylinux_{GLIBC[0]}_{GLIBC[1]}", "--exclude-newer", exclude_newer]
    with tempfile.TemporaryDirectory(prefix="mtc-lock-") as tmp:
        if pinned:
            constraints = Path(tmp) / "pins.txt"
            constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pinned.items())))
            cmd += ["--constraint", str(constraints)]
        out = subprocess.run(cmd, input="\n".join(requirements) + "\n", capture_output=True, text=True)
    if out.returncode != 0:
        raise LockError(f"uv could not resolve {' '.join(requirements)} for Python {python} "
                        f"(exit {out.returncode}):\n{out.stderr.strip()}")
    return out.stdout


def render_lock(resolved: str, requirements: Sequence[str], python: str, mtc: str, protocol: str,
                exclude_newer: str) -> str:
    """The lock file: a header that says what was resolved, for what, and how, then uv's pins."""
    lines = [
        "# images/requirements.lock: generated by `python images/build.py lock`; do not edit.",
        "# The head and the sidecar images all install exactly this",
        "# (pip install --require-hashes --no-deps), then the mtc wheel with --no-deps.",
        "# `python images/build.py lock --check` resolves it again from the fields below.",
        f"# base-image: {BASE_IMAGE}",
        f"# python: {python}",
        f"# platform: {ARCH}-manylinux_{GLIBC[0]}_{GLIBC[1]} (glibc of the base image)",
        f"# exclude-newer: {exclude_newer}",
        f"# mtc: {mtc}",
        f"# protocol: {protocol}",
        f"# requires: {' '.join(sorted(requirements))}",
        "",
    ]
    body = [line for line in resolved.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    text = "\n".join(lines + body) + "\n"
    lock = parse_lock(text)
    missing = sorted(n for n, h in lock.hashes.items() if not h)
    if missing:
        raise LockError(f"uv gave no sha256 for {', '.join(missing)}; the images install with --require-hashes")
    return text


# The versions the images are built with, for the renderer (`mtc manifests render` names these tags):
# written with the lock, from it; `lock --check` checks it.
IMAGE_VERSIONS = REPO / "head" / "tools" / "k8s" / "image_versions.json"


def image_versions_text(lock: Lock) -> str:
    return json.dumps({"mtc": lock.mtc, "python": lock.python, "jax": lock.jax}, indent=1) + "\n"


def cmd_lock(args: argparse.Namespace) -> int:
    python = python_minor_of_image(BASE_IMAGE)
    path = Path(args.lock)
    reqs = runtime_requirements() + list(args.constraint)
    if args.check:
        try:
            old = read_lock(path)
        except (OSError, ValueError) as e:
            print(f"error: cannot read the lock {path}: {e}", file=sys.stderr)
            return 1
        exclude_newer = old.header.get("exclude-newer", "")
        if not exclude_newer:
            print(f"error: {path} records no '# exclude-newer:' date, so its resolution cannot be repeated; "
                  "run python images/build.py lock", file=sys.stderr)
            return 1
        reqs = old.header.get("requires", "").split()
    else:
        exclude_newer = args.exclude_newer or utc_now()
    try:
        text = render_lock(resolve(reqs, python, exclude_newer, old.pins if args.check else None), reqs, python,
                           project()["version"],
                           protocol_version(), exclude_newer)
    except LockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lock = parse_lock(text)
    if args.check:
        if text != path.read_text():
            import difflib

            diff = difflib.unified_diff(path.read_text().splitlines(), text.splitlines(), str(path),
                                        f"resolved again (exclude-newer {exclude_newer})", lineterm="", n=0)
            print("\n".join(list(diff)[:40]))
            print(f"{path} differs from what uv resolves today with the same requirements, date and pins; "
                  "run python images/build.py lock to re-lock", file=sys.stderr)
            return 1
        if path == LOCK and (not IMAGE_VERSIONS.exists() or IMAGE_VERSIONS.read_text() != image_versions_text(lock)):
            print(f"{IMAGE_VERSIONS} does not hold the lock's versions ({tag(lock)}), which mtc manifests render "
                  "names in its image tags; run python images/build.py lock", file=sys.stderr)
            return 1
        print(f"ok: {path} is reproduced exactly from its requirements and pins: {len(lock.pins)} pins, every "
              f"file's hash, resolved with files before {exclude_newer}, tag {tag(lock)}")
        return 0
    path.write_text(text)
    if path == LOCK:
        IMAGE_VERSIONS.write_text(image_versions_text(lock))
    print(f"wrote {path}: {len(lock.pins)} pins, jax {lock.jax}, tag {tag(lock)} (files before {exclude_newer})")
    return 0


def cmd_tags(args: argparse.Namespace) -> int:
    for ref in image_refs(read_lock(Path(args.lock)), args.registry).values():
        print(ref)
    return 0


def _git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def engine_answers(engine: str) -> bool:
    """True when ``engine`` (docker or podman) is installed and answers (a CLI alone builds nothing)."""
    if shutil.which(engine) is None:
        return False
    try:
        return subprocess.run([engine, "info"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# A fixed time for every file in the wheel: the same source gives the same wheel, byte for byte,
# so an image rebuilt from an unchanged checkout hits the build cache at `COPY dist/*.whl`.
WHEEL_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry


def cmd_build(args: argparse.Namespace) -> int:
    lock_path = Path(args.lock)
    default_lock = lock_path.resolve() == LOCK
    if not default_lock and args.dry_run:
        print("error: --dry-run prints the commands for images/requirements.lock, run from the repository root; "
              "another --lock is built from a staged context, so run it without --dry-run", file=sys.stderr)
        return 2
    try:
        lock = read_lock(lock_path)
    except (OSError, ValueError) as e:
        print(f"error: cannot read the lock {lock_path}: {e}", file=sys.stderr)
        return 1
    problems = consistency_problems(lock)
    if problems:
        print("error: not building, the lock and the Dockerfiles disagree:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    text = lock_path.read_text()
    if args.base and python_minor_of_image(args.base) not in (None, lock.python):
        print(f"error: --base={args.base} is Python {python_minor_of_image(args.base)}, the lock is Python "
              f"{lock.python}; give a base with Python {lock.python}", file=sys.stderr)
        return 2
    if args.colocated_base:
        problem = colocated_base_problem(lock, args.colocated_base)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    else:
        print(f"note: skipping mtc-{COLOCATED} (no --colocated-base; give the Pathways colocated Python "
              f"sidecar image, e.g. {COLOCATED_BASE_EXAMPLE.format(python=lock.python, jax=lock.jax)})",
              file=sys.stderr)
    engine = args.engine
    if engine == "auto":
        engine = next((e for e in ("docker", "podman") if not args.dry_run and engine_answers(e)), "docker")
    # Relative paths: the printed commands are run from the repository root, like the build ones.
    wheel_cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                 str(DIST.relative_to(REPO)), "."]
    with tempfile.TemporaryDirectory(prefix="mtc-image-context-") as staged:
        context = None
        if not default_lock:  # the Dockerfiles COPY requirements.lock and dist/*.whl from the context
            context = staged
            shutil.copyfile(lock_path, Path(staged) / "requirements.lock")
        cmds = docker_commands(lock, text, args.registry, _git_revision(), args.colocated_base, engine=engine,
                               base=args.base, context=context, options=args.build_opt)
        if args.dry_run:
            for cmd in [wheel_cmd] + cmds:
                print(shlex.join(cmd))
            return 0
        shutil.rmtree(DIST, ignore_errors=True)  # exactly one wheel: the Dockerfiles COPY dist/*.whl
        env = dict(os.environ, SOURCE_DATE_EPOCH=os.environ.get("SOURCE_DATE_EPOCH", WHEEL_EPOCH))
        subprocess.run(wheel_cmd, check=True, cwd=REPO, env=env)
        if context:
            shutil.copytree(DIST, Path(staged) / "dist")
        if not engine_answers(engine):
            print(f"# no {engine} engine here: run these from the repository root where one is", file=sys.stderr)
            for cmd in cmds:
                print(shlex.join(cmd))
            return 0
        for cmd in cmds:
            print("+ " + shlex.join(cmd), file=sys.stderr)
            t0 = time.monotonic()
            done = subprocess.run(cmd, cwd=REPO)
            if done.returncode != 0:
                print(f"error: {cmd[0]} build of {cmd[cmd.index('--tag') + 1]} failed (exit {done.returncode})",
                      file=sys.stderr)
                return 1
            print(f"built {cmd[cmd.index('--tag') + 1]} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0


def consistency_problems(lock: Lock) -> list[str]:
    """What is wrong between the lock, pyproject.toml and the Dockerfiles (no environment)."""
    problems = []
    if lock.pins.get("jaxlib") != lock.jax:
        problems.append(f"jaxlib: lock {lock.pins.get('jaxlib')}, jax {lock.jax} (must be equal)")
    if lock.mtc != project()["version"]:
        problems.append(f"mtc: lock {lock.mtc}, pyproject.toml {project()['version']} "
                        "(run: python images/build.py lock)")
    if lock.header.get("protocol") != protocol_version():
        problems.append(f"protocol: lock {lock.header.get('protocol')}, shared/version.py "
                        f"{protocol_version()} (run: python images/build.py lock)")
    reqs = runtime_requirements()
    # Extra constraints given to `lock --constraint` (jax==X, say) may stand beside pyproject's.
    if not set(reqs) <= set(lock.header.get("requires", "").split()):
        problems.append("requires: pyproject.toml dependencies changed since the lock was made "
                        "(run: python images/build.py lock)")
    for req in reqs:
        if requirement_name(req) not in lock.pins:
            problems.append(f"{requirement_name(req)}: required by pyproject.toml, not pinned in the lock")
    missing_hash = sorted(n for n, h in lock.hashes.items() if not h)
    if missing_hash:
        problems.append(f"no --hash for {', '.join(missing_hash)} (the images install with --require-hashes)")
    base = lock.header.get("base-image", "")
    if python_minor_of_image(base) != lock.python:
        problems.append(f"python: lock {lock.python}, its base image {base!r}")
    for role, path in DOCKERFILES.items():
        text = path.read_text()
        default = dockerfile_arg_default(text, "BASE_IMAGE")
        if role == COLOCATED:
            if default is not None:  # its base is Google's server image, given with --colocated-base
                problems.append(f"{path.name}: ARG BASE_IMAGE={default}; it must have no default")
        elif default != base:
            problems.append(f"{path.name}: ARG BASE_IMAGE={default}, lock base-image {base}")
        if "requirements.lock" not in text or "--require-hashes" not in text:
            problems.append(f"{path.name}: does not install requirements.lock with --require-hashes")
    return problems


def fingerprint_from_lock(lock: Lock, keys: Sequence[str]) -> dict:
    """The fingerprint an image built from ``lock`` would report, for the keys given
    (a package the lock does not pin reports None, as ``fingerprint()`` does when absent)."""
    fp: dict = {"mtc": lock.mtc, "python": lock.python}
    if "protocol" in lock.header:
        fp["protocol"] = int(lock.header["protocol"])
    for key in keys:
        if key not in fp:
            fp[key] = lock.pins.get(normalize(key))
    return fp


def environment_problems(lock: Lock) -> tuple[list[str], list[str]]:
    """(mismatches, notes) between the lock and this environment's fingerprint.

    A mismatch is what ``mtc.shared.version.mismatches`` would refuse between a head running
    here and a sidecar built from the lock. A package installed here but absent from the lock
    (orbax-checkpoint in a bench environment) is a note: both images lack it, so they agree.
    """
    from mtc.shared import version

    env = version.fingerprint()
    image = fingerprint_from_lock(lock, list(env))
    mismatches, notes = [], []
    for key, env_v, img_v in version.mismatches(env, image):
        if img_v is None and normalize(key) not in lock.pins and key not in ("mtc", "protocol", "python"):
            notes.append(f"{key} {env_v} is installed here but not in the images (both images lack it)")
        else:
            mismatches.append(f"{key}: lock {img_v}, this environment {env_v}")
    return mismatches, notes


def cmd_check(args: argparse.Namespace) -> int:
    lock_path = Path(args.lock)
    try:
        lock = read_lock(lock_path)
    except (OSError, ValueError) as e:
        print(f"error: cannot read the lock {lock_path}: {e}", file=sys.stderr)
        return 1
    problems = consistency_problems(lock)
    mismatches, notes = environment_problems(lock)
    for note in notes:
        print(f"note: {note}")
    if problems or mismatches:
        print(f"{lock_path} disagrees with {'the repository' if problems else ''}"
              f"{' and ' if problems and mismatches else ''}{'this environment' if mismatches else ''}:")
        for line in problems + mismatches:
            print(f"  {line}")
        return 1
    print(f"ok: {lock_path.name}, Dockerfiles and this environment agree on {tag(lock)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python images/build.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (("lock", cmd_lock, "re-resolve the lock from pyproject.toml"),
                ("tags", cmd_tags, "print the head, sidecar and colocated sidecar image references"),
                ("build", cmd_build, "build the mtc wheel and the images"),
                ("check", cmd_check, "the lock, the Dockerfiles and this environment agree"))
    for name, func, helptext in commands:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--lock", default=str(LOCK), help="lock file (default: images/requirements.lock)")
        if name in ("tags", "build"):
            p.add_argument("--registry", default="", help="e.g. us-docker.pkg.dev/PROJECT/REPO")
        if name == "build":
            p.add_argument("--colocated-base", default="", metavar="IMAGE",
                           help="Pathways colocated Python sidecar image to build mtc-colocated-sidecar on, "
                                "tagged ...-python_X.Y-jax_X.Y.Z as the lock (without it that image is skipped)")
            p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
            p.add_argument("--engine", choices=("auto", "docker", "podman"), default="auto",
                           help="what builds the images (default: docker when its engine answers, else podman)")
            p.add_argument("--base", default="", metavar="IMAGE",
                           help="base image of mtc-head and mtc-sidecar instead of the lock's base-image "
                                "(the same Python minor)")
            p.add_argument("--build-opt", action="append", default=[], metavar="OPT",
                           help="passed to every build command, e.g. --build-opt=--volume=/w:/w:ro (repeatable)")
        if name == "lock":
            p.add_argument("--check", action="store_true",
                           help="resolve again with the lock's own requirements and exclude-newer date and "
                                "compare (exit 1 on any difference); writes nothing")
            p.add_argument("--exclude-newer", default="", metavar="UTC",
                           help="only files uploaded before this time, e.g. 2026-12-01T00:00:00Z (default: now)")
            p.add_argument("--constraint", action="append", default=[], metavar="REQ",
                           help="an extra requirement, e.g. jax==0.10.2 (recorded in the header; repeatable)")
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
