"""Build the head and sidecar images from one lock file (DESIGN section 8).

The head refuses to run against sidecars whose jax/jaxlib/python/mtc differ from its own
(``mtc.shared.version``). This script makes that refusal rare: every image installs the same
``images/requirements.lock``, and is tagged and labelled with the versions read from that
lock, never from whatever interpreter runs the script. ``mtc-head`` and ``mtc-sidecar`` (the
cluster-mode daemon) share one base image; ``mtc-colocated-sidecar`` (colocated mode on
Pathways, what ``mtc manifests render`` runs on the workers) is built on Google's colocated
Python sidecar image (``--colocated-base``), whose tag must carry the lock's python and jax.

    python images/build.py lock                      # re-resolve requirements.lock (pip --dry-run --report)
    python images/build.py tags [--registry R]       # the three image references
    python images/build.py build [--registry R] [--colocated-base IMAGE] [--dry-run]
    python images/build.py check [--lock FILE]       # lock, Dockerfiles and this environment agree

Runs with any Python >= 3.11 (tomllib); only ``check`` needs mtc installed (it compares with
``mtc.shared.version.fingerprint()``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
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
BASE_IMAGE = "python:3.11.14-slim-bookworm"
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
                    revision: str | None = None, colocated_base: str = "") -> list[list[str]]:
    """One ``docker build`` command per image, run from the repository root with ``images/``
    as the context (it holds the lock and ``dist/`` with the wheel, nothing else is sent).
    The colocated sidecar is built on ``colocated_base``, and left out without one."""
    refs = image_refs(lock, registry)
    cmds = []
    for role, dockerfile in DOCKERFILES.items():
        args = build_args(lock, lock_text)
        if role == COLOCATED:
            if not colocated_base:
                continue
            args["BASE_IMAGE"] = colocated_base
        cmd = ["docker", "build", "--platform", f"linux/{'amd64' if ARCH == 'x86_64' else ARCH}",
               "--file", str(dockerfile.relative_to(REPO)), "--tag", refs[role]]
        for key, value in args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if revision:
            cmd += ["--label", f"org.opencontainers.image.revision={revision}"]
        cmd.append(str(IMAGES.relative_to(REPO)))
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

def resolve(requirements: Sequence[str], python: str) -> list[dict]:
    """Run pip's resolver for the image platform; the ``install`` list of its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", "--abi", "cp" + python.replace(".", "")]
        for p in platforms():
            cmd += ["--platform", p]
        subprocess.run(cmd + list(requirements), check=True)
        return json.loads(report.read_text())["install"]


def render_lock(installs: Sequence[dict], requirements: Sequence[str], python: str,
                mtc: str, protocol: str) -> str:
    """The lock text for pip's ``install`` report entries, sorted by name."""
    lines = [
        "# images/requirements.lock: generated by `python images/build.py lock`; do not edit.",
        "# The head and the sidecar image both install exactly this",
        "# (pip install --require-hashes --no-deps), then the mtc wheel with --no-deps.",
        f"# base-image: {BASE_IMAGE}",
        f"# python: {python}",
        f"# platform: manylinux_{GLIBC[0]}_{GLIBC[1]}_{ARCH} (glibc of the base image)",
        f"# mtc: {mtc}",
        f"# protocol: {protocol}",
        f"# requires: {' '.join(sorted(requirements))}",
        "",
    ]
    for item in sorted(installs, key=lambda i: normalize(i["metadata"]["name"])):
        name = normalize(item["metadata"]["name"])
        version = item["metadata"]["version"]
        digest = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
        if not digest:
            raise ValueError(f"pip reported no sha256 for {name}=={version}; cannot lock it")
        lines += [f"{name}=={version} \\", f"    --hash=sha256:{digest}"]
    return "\n".join(lines) + "\n"


def cmd_lock(args: argparse.Namespace) -> int:
    python = python_minor_of_image(BASE_IMAGE)
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python != running:
        # pip evaluates environment markers against the running interpreter, not --python-version.
        print(f"error: run `lock` with Python {python} (the base image's), not {running}", file=sys.stderr)
        return 1
    reqs = runtime_requirements()
    text = render_lock(resolve(reqs, python), reqs, python, project()["version"], protocol_version())
    Path(args.lock).write_text(text)
    lock = parse_lock(text)
    print(f"wrote {args.lock}: {len(lock.pins)} pins, jax {lock.jax}, tag {tag(lock)}")
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


def _docker_engine() -> bool:
    """True when a docker CLI is installed and its engine answers (a CLI alone builds nothing)."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cmd_build(args: argparse.Namespace) -> int:
    lock_path = Path(args.lock)
    if lock_path.resolve() != LOCK:
        print("error: build installs images/requirements.lock (the Dockerfiles COPY it); "
              "--lock only applies to tags and check", file=sys.stderr)
        return 2
    problems = consistency_problems(read_lock(lock_path))
    if problems:
        print("error: not building, the lock and the Dockerfiles disagree:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    text = lock_path.read_text()
    lock = parse_lock(text)
    if args.colocated_base:
        problem = colocated_base_problem(lock, args.colocated_base)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    else:
        print(f"note: skipping mtc-{COLOCATED} (no --colocated-base; give the Pathways colocated Python "
              f"sidecar image, e.g. {COLOCATED_BASE_EXAMPLE.format(python=lock.python, jax=lock.jax)})",
              file=sys.stderr)
    # Relative paths: the printed commands are run from the repository root, like the docker ones.
    wheel_cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                 str(DIST.relative_to(REPO)), "."]
    docker = docker_commands(lock, text, args.registry, _git_revision(), args.colocated_base)
    if args.dry_run:
        for cmd in [wheel_cmd] + docker:
            print(shlex.join(cmd))
        return 0
    shutil.rmtree(DIST, ignore_errors=True)  # exactly one wheel: the Dockerfiles COPY dist/*.whl
    subprocess.run(wheel_cmd, check=True, cwd=REPO)
    if not _docker_engine():
        print("# no docker engine here: run these from the repository root where one is", file=sys.stderr)
        for cmd in docker:
            print(shlex.join(cmd))
        return 0
    for cmd in docker:
        print("+ " + shlex.join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, cwd=REPO)
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
    if lock.header.get("requires") != " ".join(sorted(reqs)):
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
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
