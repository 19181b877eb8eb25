"""Session fixtures of the image tests: podman's settings, the base, the built images (tests/images/oci.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oci  # noqa: E402

LOCK, SKEW_JAX = oci.LOCK, oci.SKEW_JAX
TIMES: dict[str, float] = {}


def _minor() -> str:
    sys.path.insert(0, str(oci.IMAGES))
    try:
        import build
    finally:
        sys.path.remove(str(oci.IMAGES))
    return build.read_lock(LOCK).python


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory):
    missing = oci.missing_tools()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: apt-get install -y podman runc mmdebstrap (.ci/run does)")
    env = oci.podman_env(tmp_path_factory.mktemp("podman"))
    info = oci.podman(env, "info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if info.returncode != 0:
        pytest.skip(f"podman does not work here: {info.stderr.strip()[-500:]}")
    return env


@pytest.fixture(scope="session")
def minor() -> str:
    return _minor()


@pytest.fixture(scope="session")
def base(podman_env, minor) -> str:
    try:
        ref, seconds = oci.ensure_base(podman_env, minor, log=lambda m: print(m, file=sys.stderr))
    except oci.Unavailable as e:
        pytest.skip(str(e))
    TIMES["base"] = seconds or 0.0
    return ref


@pytest.fixture(scope="session")
def build_setup(tmp_path_factory, minor):
    """(wheel folder of the lock, offline pip.conf): what every build mounts."""
    return oci.ensure_wheels(LOCK, minor), oci.offline_pip_conf(tmp_path_factory.mktemp("pip"))


@pytest.fixture(scope="session")
def images(podman_env, base, build_setup, minor) -> dict[str, str]:
    wheels, pip_conf = build_setup
    built = oci.build_images(podman_env, lock=LOCK, base=base, wheels=wheels, pip_conf=pip_conf, minor=minor)
    TIMES["head+sidecar"] = built.seconds
    return built.refs


@pytest.fixture(scope="session")
def skew(podman_env, base, build_setup, minor, tmp_path_factory) -> dict[str, str]:
    """Head and sidecar images built from a lock with jax SKEW_JAX (the same mtc source)."""
    lock = oci.skew_lock(LOCK, SKEW_JAX)
    wheels = oci.ensure_wheels(lock, minor)
    built = oci.build_images(podman_env, lock=lock, base=base, wheels=wheels, pip_conf=build_setup[1], minor=minor)
    TIMES["skewed head+sidecar"] = built.seconds
    return built.refs


@pytest.fixture
def containers(podman_env):
    c = oci.Containers(podman_env)
    yield c
    c.close()


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.write_line("image builds (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMES.items())
                                    + " (0: found in podman's storage)")
