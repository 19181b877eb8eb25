"""Build and run mtc's OCI images on this machine with podman (no Docker engine here).

The head and sidecar images are built from ``images/`` by ``images/build.py build --engine
podman`` on a base made here: Debian packages (``mmdebstrap``) plus a CPython of the lock's
minor version copied in (pyenv's, say: ``$(pyenv root)/versions/3.12.*``), standing in for
``python:3.12-slim-bookworm``, which cannot be pulled here. Everything is cached in podman's
storage and in ``$MTC_CACHE`` (default ``~/.cache/mtc``), keyed on what it was built from:

- the base is tagged with a hash of its recipe (suite, packages, this module's recipe code,
  the interpreter's version and files): an unchanged recipe is never rebuilt;
- the lock's wheels are downloaded once per lock (``pip download --require-hashes``) and the
  builds install them offline from a mounted folder (``/etc/pip.conf`` inside the build says
  ``no-index``): the same files, by hash, as the images would fetch;
- the images are tagged under ``localhost/mtc-test-<hash of the lock and the mtc source>``,
  and podman's layer cache makes a rebuild of unchanged inputs a cache hit at every step.

podman needs two settings on this machine (crun cannot set RLIMIT_NOFILE on it): a
containers.conf with ``default_ulimits = []`` and the ``runc`` runtime, given to every podman
command through ``CONTAINERS_CONF``.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
SUITE = "bookworm"  # the production base's Debian: glibc 2.36, what the lock's wheels are for
MIRROR = os.environ.get("MTC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the copied CPython links against (its extension modules: ssl, ctypes, sqlite3, lzma, ...),
# plus ca-certificates and passwd (useradd, which the Dockerfiles run).
PACKAGES = ("ca-certificates", "passwd", "libbz2-1.0", "libcrypt1", "libexpat1", "libffi8", "liblzma5",
            "libncursesw6", "libnsl2", "libreadline8", "libsqlite3-0", "libssl3", "libtinfo6", "libtirpc3",
            "libuuid1", "zlib1g")
# Parts of the interpreter tree an image never uses (tests, Tk, the static library, old pip).
_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "site-packages", "__pycache__"}
_SKIP_SUFFIXES = (".a",)
_SKIP_PREFIXES = ("_tkinter", "pip", "idle", "2to3", "pydoc")
BASE_REPOSITORY = "localhost/mtc-test-base"
LOCK = IMAGES / "requirements.lock"
SKEW_JAX = "0.10.2"  # another jax release with wheels for the lock's Python: the skewed sidecar's
TOOLS = ("podman", "runc", "mmdebstrap")


class Unavailable(RuntimeError):
    """Something this machine lacks to build or run the images; the message says what."""


def cache_dir() -> Path:
    d = Path(os.environ.get("MTC_CACHE", Path.home() / ".cache" / "mtc")) / "images"
    d.mkdir(parents=True, exist_ok=True)
    return d


# ------------------------------------------------------------------------------- podman


def podman_env(workdir: Path) -> dict[str, str]:
    """The environment for every podman command: this machine's containers.conf settings."""
    conf = workdir / "containers.conf"
    runc = shutil.which("runc")
    if runc is None:
        raise Unavailable("runc is not installed (apt-get install -y runc): crun cannot run containers here")
    conf.write_text("[containers]\ndefault_ulimits = []\n\n[engine]\n"
                    f"runtime = \"runc\"\n\n[engine.runtimes]\nrunc = [\"{runc}\"]\n")
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def podman(env: dict, *args: str, timeout: float = 600, check: bool = True, input: str | None = None,
           ) -> subprocess.CompletedProcess:
    """Run ``podman ARGS``; on failure (with ``check``) raise with podman's own words."""
    out = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout, input=input)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed (exit {out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def image_exists(env: dict, ref: str) -> bool:
    return podman(env, "image", "exists", ref, check=False).returncode == 0


def labels(env: dict, ref: str) -> dict[str, str]:
    doc = json.loads(podman(env, "image", "inspect", ref).stdout)
    return doc[0]["Config"].get("Labels") or {}


# ------------------------------------------------------------------------------- the base


def find_python(minor: str) -> Path:
    """The installation prefix of a CPython ``minor`` (e.g. "3.12") to copy into the base:
    ``$MTC_IMAGE_PYTHON`` (an interpreter), else the newest ``$(pyenv root)/versions/<minor>.*``."""
    cands = [os.environ.get("MTC_IMAGE_PYTHON", "")]
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    if shutil.which("pyenv"):
        r = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        root = r.stdout.strip() or root
    cands += sorted(glob.glob(f"{root}/versions/{minor}.*/bin/python{minor}"),
                    key=lambda p: [int(x) for x in Path(p).parents[1].name.split(".") if x.isdigit()], reverse=True)
    for c in filter(None, cands):
        r = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2]); print(sys.base_prefix)"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split()[0] == minor:
            return Path(r.stdout.split()[1])
    raise Unavailable(f"no CPython {minor} to put in the base image: set MTC_IMAGE_PYTHON to one "
                      f"(with pyenv: pyenv install {minor}, then $(pyenv root)/versions/{minor}.N/bin/python{minor})")


def _skip(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in _SKIP or n.endswith(_SKIP_SUFFIXES)
            or (n.startswith(_SKIP_PREFIXES) and (directory.endswith("/bin") or "lib-dynload" in directory))}


def _python_identity(prefix: Path, minor: str) -> str:
    exe = prefix / "bin" / f"python{minor}"
    out = subprocess.run([str(exe), "-c", "import sys; print(sys.version)"], capture_output=True, text=True)
    parts = [out.stdout.strip()]
    for f in sorted(prefix.glob("lib/libpython*")) + [exe]:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{int(st.st_mtime)}")
    return "\n".join(parts)


def base_ref(minor: str) -> tuple[str, Path]:
    """The base image's reference (tagged ``<python version>-<suite>-<recipe hash>``) and the
    prefix of the interpreter it copies."""
    prefix = find_python(minor)
    recipe = "\n".join([SUITE, MIRROR, " ".join(PACKAGES), inspect.getsource(_make_rootfs),
                        inspect.getsource(_skip), repr(sorted(_SKIP)), _python_identity(prefix, minor)])
    full = subprocess.run([str(prefix / "bin" / f"python{minor}"), "-c",
                           "import platform; print(platform.python_version())"], capture_output=True, text=True)
    key = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{full.stdout.strip()}-{SUITE}-{key}", prefix


def _make_rootfs(rootfs: Path, prefix: Path, minor: str, log) -> None:
    """Debian ``SUITE`` (minbase and ``PACKAGES``) in ``rootfs``, the interpreter in /usr/local."""
    if rootfs == Path("/") or not rootfs.is_absolute():
        raise ValueError(f"refusing to build a root filesystem in {rootfs}")
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(PACKAGES),
                    "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                    "--dpkgopt=path-exclude=/usr/share/locale/*", SUITE, str(rootfs), MIRROR],
                   check=True, capture_output=True, text=True)
    local = rootfs / "usr" / "local"
    shutil.copytree(prefix, local, symlinks=True, ignore=_skip, dirs_exist_ok=True)
    for name in ("python", "python3"):
        link = local / "bin" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f"python{minor}")
    # The copied libpython's RUNPATH names the prefix it was built in; /usr/local/lib is on the
    # loader's default path once the cache knows it.
    subprocess.run(["ldconfig", "-r", str(rootfs)], check=True)
    py = f"/usr/local/bin/python{minor}"
    subprocess.run(["chroot", str(rootfs), py, "-m", "ensurepip", "--default-pip"], check=True,
                   capture_output=True, text=True)
    check = subprocess.run(["chroot", str(rootfs), py, "-c", "import ssl, ctypes, sqlite3, lzma, bz2, zlib, uuid, "
                            "readline, venv; import sys; print(sys.prefix)"], capture_output=True, text=True)
    if check.returncode != 0 or check.stdout.strip() != "/usr/local":
        raise RuntimeError(f"the copied interpreter does not work in the base: {check.stdout}{check.stderr}")


def ensure_base(env: dict, minor: str, log=print) -> tuple[str, float | None]:
    """The base image for ``minor``, built unless podman already has it; (ref, build seconds or None)."""
    ref, prefix = base_ref(minor)
    if image_exists(env, ref):
        return ref, None
    t0 = time.monotonic()
    log(f"building the base image {ref} (Debian {SUITE} from {MIRROR} + CPython from {prefix})")
    with tempfile.TemporaryDirectory(prefix="mtc-base-", dir=cache_dir()) as tmp:
        rootfs = Path(tmp) / "rootfs"
        _make_rootfs(rootfs, prefix, minor, log)
        tar = Path(tmp) / "rootfs.tar"
        with tarfile.open(tar, "w") as t:
            for entry in sorted(rootfs.iterdir()):
                t.add(entry, arcname=entry.name)
        podman(env, "import", "--change", 'CMD ["python3"]', "--change",
               "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin", str(tar), ref)
    return ref, time.monotonic() - t0


# ------------------------------------------------------------------------------- wheels


def platforms() -> list[str]:
    """pip ``--platform`` tags of the image (build.py's, most specific first)."""
    sys.path.insert(0, str(IMAGES))
    try:
        import build  # noqa: PLC0415  images/build.py, loaded by path
    finally:
        sys.path.remove(str(IMAGES))
    return build.platforms()


def ensure_wheels(lock: Path, minor: str) -> Path:
    """A folder with every file of ``lock`` for the image platform, downloaded once per lock text."""
    key = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    dest = cache_dir() / f"wheels-{key}"
    done = dest / ".complete"
    if done.exists():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f"wheels-{key}-", dir=cache_dir()))
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--python-version", minor, "--implementation", "cp", "--abi", "cp" + minor.replace(".", ""),
           "--dest", str(tmp), "-r", str(lock)]
    for p in platforms():
        cmd += ["--platform", p]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"pip download of {lock} failed:\n{out.stderr[-3000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    done.write_text("")
    return dest


def offline_pip_conf(workdir: Path) -> Path:
    """``/etc/pip.conf`` for the builds: install only from the mounted wheel folder."""
    conf = workdir / "pip.conf"
    conf.write_text("[global]\nno-index = true\nfind-links = /wheels\n")
    return conf


# ------------------------------------------------------------------------------- images


def source_key(lock: Path) -> str:
    """A hash of what the images are built from: the lock, the Dockerfiles and mtc's source."""
    h = hashlib.sha256()
    files = [lock, REPO / "pyproject.toml", *sorted(IMAGES.glob("Dockerfile.*"))]
    for pkg in ("head", "sidecar", "shared"):
        files += sorted((REPO / pkg).rglob("*.py"))
    for f in files:
        h.update(str(f.relative_to(REPO) if f.is_relative_to(REPO) else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


@dataclass
class Built:
    refs: dict[str, str]  # role -> image reference
    seconds: float
    output: str


def build_images(env: dict, *, lock: Path, base: str, wheels: Path, pip_conf: Path, minor: str,
                 colocated_base: str = "", registry: str = "", check: bool = True) -> Built:
    """``images/build.py build --engine podman`` for ``lock`` on ``base``; the image references."""
    sys.path.insert(0, str(IMAGES))
    try:
        import build  # noqa: PLC0415
    finally:
        sys.path.remove(str(IMAGES))
    registry = registry or f"localhost/mtc-test-{source_key(lock)}"
    cmd = [sys.executable, str(IMAGES / "build.py"), "build", "--engine", "podman", "--lock", str(lock),
           "--base", base, "--registry", registry, f"--build-opt=--volume={wheels}:/wheels:ro",
           f"--build-opt=--volume={pip_conf}:/etc/pip.conf:ro", "--build-opt=--network=none"]
    if colocated_base:
        cmd += ["--colocated-base", colocated_base]
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=1800)
    seconds = time.monotonic() - t0
    if check and out.returncode != 0:
        raise RuntimeError(f"images/build.py build failed (exit {out.returncode}):\n{out.stderr[-6000:]}")
    refs = build.image_refs(build.read_lock(lock), registry)
    if not colocated_base:
        refs.pop(build.COLOCATED)
    return Built(refs, seconds, out.stdout + out.stderr)


def skew_lock(lock: Path, jax: str) -> Path:
    """A lock like ``lock`` (same requirements, same date) with jax and jaxlib ``jax``: what a
    sidecar image built from another release would install. Resolved once (uv), then cached."""
    key = hashlib.sha256(lock.read_bytes() + jax.encode()).hexdigest()[:16]
    dest = cache_dir() / f"skew-{key}" / "requirements.lock"
    if dest.exists():
        return dest
    sys.path.insert(0, str(IMAGES))
    try:
        import build  # noqa: PLC0415
    finally:
        sys.path.remove(str(IMAGES))
    when = build.read_lock(lock).header["exclude-newer"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    out = subprocess.run([sys.executable, str(IMAGES / "build.py"), "lock", "--lock", str(tmp), "--exclude-newer",
                          when, "--constraint", f"jax=={jax}", "--constraint", f"jaxlib=={jax}"],
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"resolving a lock with jax {jax} failed:\n{out.stderr[-3000:]}")
    tmp.rename(dest)
    return dest


# ------------------------------------------------------------------------------- containers


class Containers:
    """Containers this test run started (named ``mtc-test-<pid>-...``), removed by ``close()``."""

    def __init__(self, env: dict):
        self.env = env
        self.prefix = f"mtc-test-{os.getpid()}"
        self.names: list[str] = []

    def run(self, image: str, *args: str, volumes: dict[Path, str] = {}, envs: dict[str, str] = {},
            secret_envs: dict[str, str] = {}, entrypoint: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Run a container to the end on the host network; its exit code and output.
        ``secret_envs`` reach the container through podman's environment (``--env NAME``), never
        its command line."""
        cmd = ["run", "--rm", "--network", "host"]
        for host, inside in volumes.items():
            cmd += ["--volume", f"{host}:{inside}"]
        for k, v in envs.items():
            cmd += ["--env", f"{k}={v}"]
        for k in secret_envs:
            cmd += ["--env", k]
        if entrypoint is not None:
            cmd += ["--entrypoint", entrypoint]
        env = dict(self.env, **secret_envs)
        return podman(env, *cmd, image, *args, check=False, timeout=timeout)

    def start(self, name: str, image: str, *args: str, volumes: dict[Path, str] = {}) -> str:
        """Start a detached container on the host network; its name."""
        full = f"{self.prefix}-{name}"
        cmd = ["run", "--detach", "--name", full, "--network", "host"]
        for host, inside in volumes.items():
            cmd += ["--volume", f"{host}:{inside}"]
        self.names.append(full)
        podman(self.env, *cmd, image, *args)
        return full

    def running(self, name: str) -> bool:
        out = podman(self.env, "inspect", "--format", "{{.State.Running}}", name, check=False)
        return out.stdout.strip() == "true"

    def logs(self, name: str) -> str:
        out = podman(self.env, "logs", name, check=False)
        return out.stdout + out.stderr

    def remove(self, name: str) -> None:
        podman(self.env, "rm", "--force", "--time", "5", name, check=False, timeout=60)
        if name in self.names:
            self.names.remove(name)

    def close(self) -> None:
        for name in list(self.names):
            self.remove(name)


def start_sidecar(containers: Containers, image: str, host_id: str, ramdisk: Path, run: Path,
                  timeout: float = 120) -> str:
    """One sidecar daemon container (the image's entrypoint, ``python -m mtc.sidecar serve``) for
    ``host_id`` with ``ramdisk`` as its /local; its control address, once it listens."""
    ready = run / f"{host_id}.ready"
    ready.unlink(missing_ok=True)
    name = containers.start(host_id, image, "--root", "/local", "--host-id", host_id, "--listen", "127.0.0.1:0",
                            "--peer-listen", "127.0.0.1:0", "--ready-file", f"/run/mtc/{host_id}.ready",
                            "--peer-token-file", "/run/mtc/token",
                            volumes={ramdisk: "/local", run: "/run/mtc"})
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if not containers.running(name):
            raise RuntimeError(f"sidecar container {name} exited:\n{containers.logs(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"sidecar container {name} did not listen in {timeout:.0f} s:\n"
                               f"{containers.logs(name)[-3000:]}")
        time.sleep(0.1)
    return json.loads(ready.read_text())["address"]


def owned_by(path: Path, uid: int = 1000, mode: int = 0o755) -> Path:
    """``path`` (created) owned by ``uid``: the images run as uid 1000."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path
