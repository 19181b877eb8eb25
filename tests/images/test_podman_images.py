"""The images, really built and run: podman on this machine (tests/images/oci.py).

mtc-head and mtc-sidecar are built from images/ by `images/build.py build --engine podman` on a
base made here (Debian bookworm packages plus CPython of the lock's minor), their labels are
checked with `mtc images check --engine podman` and against what each container reports, two
sidecar containers form a 1 slice x 2 hosts cluster on the host network, and head containers
save a state and restore it (a new head process, as after a restart) bit for bit. A sidecar
image built from a lock with another jax is refused by `mtc images check` and by the head, with
the table. Of the colocated sidecar image, which is built on Google's colocated Python server
image in production, what can be tested here is: its build (base check, lock, wheel, checks)
on a stand-in base that carries the lock's python and jax, and its refusal of a base with
another jax.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import oci
from oci import LOCK, SKEW_JAX

from mtc.shared import protocol
from mtc.shared.config import ENV_TOKEN

pytestmark = [pytest.mark.images, pytest.mark.integration]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(oci.IMAGES))
import build  # noqa: E402  images/build.py
sys.path.remove(str(oci.IMAGES))

LABEL_KEYS = {"mtc": "mtc.version", "protocol": "mtc.protocol", "python": "mtc.python", "jax": "mtc.jax",
              "jaxlib": "mtc.jaxlib"}


def _mtc(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _fingerprint(containers: oci.Containers, image: str) -> dict:
    out = containers.run(image, "-c", "import json; from mtc.shared.version import fingerprint; "
                                      "print(json.dumps(fingerprint()))", entrypoint="python")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_labels_equal_the_lock_and_what_each_container_reports(podman_env, images, containers):
    lock = build.read_lock(LOCK)
    want = {"mtc": lock.mtc, "protocol": lock.header["protocol"], "python": lock.python, "jax": lock.jax,
            "jaxlib": lock.pins["jaxlib"]}
    for role, ref in images.items():
        assert ref.endswith(":" + build.tag(lock)), ref
        labels = oci.labels(podman_env, ref)
        assert {k: labels[v] for k, v in LABEL_KEYS.items()} == want, role
        assert labels["mtc.role"] == role and labels["mtc.lock-sha256"] == build.build_args(
            lock, LOCK.read_text())["LOCK_SHA256"]
        fp = _fingerprint(containers, ref)  # what the head compares at start-up
        assert {k: str(fp[k]) for k in LABEL_KEYS} == want, (role, fp)
        for pkg in ("numpy", "cloudpickle", "ml_dtypes"):
            assert fp[pkg] == lock.pins[pkg.replace("_", "-")], (role, pkg)
    ok = _mtc("images", "check", "--engine", "podman", images["head"], images["sidecar"], env=podman_env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "labels (podman):" in ok.stdout and "(tags and labels)" in ok.stdout


def test_build_py_check_agrees_inside_the_head_image(images, containers):
    """`python images/build.py check` in an environment installed from the lock: the only place
    its environment comparison can pass (this venv is the tests' Python, not the lock's)."""
    out = containers.run(images["head"], "python", "/repo/images/build.py", "check",
                         volumes={oci.REPO: "/repo:ro"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ok: requirements.lock, Dockerfiles and this environment agree on {build.tag(build.read_lock(LOCK))}" \
        in out.stdout


def _cluster(containers, image, tmp_path, hosts=("s0-h0", "s0-h1")) -> tuple[Path, dict[str, Path]]:
    """Sidecar containers for ``hosts`` (one slice); the cluster spec file and each host's ramdisk."""
    run = oci.owned_by(tmp_path / "run")
    token = run / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    os.chown(token, 1000, 1000)
    ram = {h: oci.owned_by(tmp_path / "ram" / h) for h in hosts}
    specs = [protocol.HostSpec(h, 0, oci.start_sidecar(containers, image, h, ram[h], run), 2) for h in hosts]
    spec = oci.owned_by(tmp_path / "job") / "cluster.json"
    protocol.ClusterSpec(tuple(specs)).write(spec)
    os.chown(spec, 1000, 1000)  # written 0600: the head runs as uid 1000
    return spec, ram


def _head(containers, image, mode: str, job: Path) -> subprocess.CompletedProcess:
    """A head container running head_job.py; it gets the job token as a head pod does, in
    MTC_PEER_TOKEN (the sidecars read the same one from their token file)."""
    (job / "head_job.py").write_text((HERE / "head_job.py").read_text())
    token = (job.parent / "run" / "token").read_text()
    return containers.run(image, "python", "/job/head_job.py", mode, "/job/cluster.json", "/job/out",
                          volumes={job: "/job"}, envs={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
                          secret_envs={ENV_TOKEN: token})


def _arrays(folder: Path) -> dict[str, tuple[str, list, bytes]]:
    meta = json.loads((folder / "arrays.json").read_text())
    return {k: (m["dtype"], m["shape"], (folder / f"{k}.bin").read_bytes()) for k, m in meta.items()}


def test_head_container_saves_and_restores_bit_for_bit_through_sidecar_containers(images, containers, tmp_path):
    spec, ram = _cluster(containers, images["sidecar"], tmp_path)
    job = spec.parent
    oci.owned_by(job / "out")
    saved = _head(containers, images["head"], "save", job)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    for h, root in ram.items():  # the bytes went to the sidecars' ramdisks, and were replicated
        assert [int(p.stem) for p in (root / "mtc" / "steps").glob("*.json")] == [5], h
    blobs = {h: {p.name for p in (root / "mtc" / "blobs").iterdir() if not p.name.startswith(".")}
             for h, root in ram.items()}
    assert blobs["s0-h0"] and blobs["s0-h0"] == blobs["s0-h1"], blobs  # replication_factor 2 on 2 hosts

    before = _arrays(job / "out" / "saved")
    assert before.keys() == {"w", "e", "c"}

    def restore_bit_for_bit() -> dict:
        restored = _head(containers, images["head"], "restore", job)  # a new head process each time
        assert restored.returncode == 0, restored.stdout + restored.stderr
        after = _arrays(job / "out" / "restored")
        assert after.keys() == before.keys()
        for k in before:
            assert before[k][:2] == after[k][:2], k  # dtype (bfloat16 too) and shape
            assert before[k][2] == after[k][2], f"{k} differs after the restore"
        report = json.loads((job / "out" / "restore.json").read_text())
        assert report["step"] == 5, report
        return report["bytes_by_tier"]

    by_tier = restore_bit_for_bit()
    assert by_tier.get("ram", 0) > 0 and not by_tier.get("peer"), by_tier
    # A host replaced: its container gone, its ramdisk empty, a new container on a new port. The
    # next restore pulls that host's shards from its peer's container, over the host network.
    containers.remove(f"{containers.prefix}-s0-h1")
    shutil.rmtree(ram["s0-h1"])
    oci.owned_by(ram["s0-h1"])
    hosts = protocol.ClusterSpec.read(spec).hosts
    address = oci.start_sidecar(containers, images["sidecar"], "s0-h1", ram["s0-h1"], tmp_path / "run")
    protocol.ClusterSpec((hosts[0], protocol.HostSpec("s0-h1", 0, address, 2))).write(spec)
    os.chown(spec, 1000, 1000)
    by_tier = restore_bit_for_bit()
    assert by_tier.get("peer", 0) > 0, by_tier


def test_a_sidecar_image_with_another_jax_is_refused(podman_env, images, skew, containers, tmp_path):
    lock = build.read_lock(LOCK)
    check = _mtc("images", "check", "--engine", "podman", images["head"], skew["sidecar"], env=podman_env)
    assert check.returncode == 1, check.stdout + check.stderr
    assert re.search(rf"^jax\s+{re.escape(lock.jax)}\s+{re.escape(SKEW_JAX)}\s+<- differs$", check.stdout, re.M)
    assert re.search(rf"^jaxlib\s+{re.escape(lock.jax)}\s+{re.escape(SKEW_JAX)}\s+<- differs$", check.stdout, re.M)
    assert "the head and sidecar images differ (jax)" in check.stderr
    fp = _fingerprint(containers, skew["sidecar"])
    assert (fp["jax"], fp["jaxlib"]) == (SKEW_JAX, SKEW_JAX)  # it really holds the other jax

    spec, ram = _cluster(containers, skew["sidecar"], tmp_path, hosts=("s0-h0",))
    job = spec.parent
    oci.owned_by(job / "out")
    # One host holding all 4 of the head's devices.
    protocol.ClusterSpec((protocol.HostSpec("s0-h0", 0, protocol.ClusterSpec.read(spec).hosts[0].address, 4),)
                         ).write(spec)
    os.chown(spec, 1000, 1000)
    head = _head(containers, images["head"], "save", job)
    assert head.returncode == 3, head.stdout + head.stderr
    refused = (job / "out" / "refused.txt").read_text()
    assert f"jax: head {lock.jax}, sidecar {SKEW_JAX} (host s0-h0)" in refused, refused
    assert f"jaxlib: head {lock.jax}, sidecar {SKEW_JAX} (host s0-h0)" in refused, refused
    assert "images/build.py" in refused
    blobs = ram["s0-h0"] / "mtc" / "blobs"
    assert not blobs.exists() or not [p for p in blobs.iterdir() if not p.name.startswith(".")]


def _standin_colocated_base(podman_env, base: str, lock_path: Path, tag_jax: str, wheels: Path, pip_conf: Path,
                            tmp_path: Path) -> str:
    """A stand-in for Google's colocated Python sidecar image: the local base with jax and jaxlib
    of ``lock_path`` installed (the server itself is not on PyPI), tagged ``-python_X.Y-jax_<tag_jax>``."""
    lock = build.read_lock(lock_path)
    ctx = tmp_path / "standin"
    ctx.mkdir()
    (ctx / "jax.lock").write_text("".join(
        f"{name}=={lock.pins[name]} " + " ".join(f"--hash={h}" for h in lock.hashes[name]) + "\n"
        for name in ("jax", "jaxlib")))
    (ctx / "Containerfile").write_text(
        "ARG BASE\nFROM ${BASE}\nCOPY jax.lock /tmp/jax.lock\n"
        "RUN pip install --no-cache-dir --require-hashes --no-deps --only-binary=:all: -r /tmp/jax.lock "
        "&& rm /tmp/jax.lock\n")
    ref = f"localhost/mtc-test-colocated-base:standin-{lock.jax}-python_{lock.python}-jax_{tag_jax}"
    oci.podman(podman_env, "build", "--build-arg", f"BASE={base}", "--volume", f"{wheels}:/wheels:ro",
               "--volume", f"{pip_conf}:/etc/pip.conf:ro", "--network", "none", "--tag", ref, str(ctx))
    return ref


def test_colocated_image_builds_on_a_base_with_the_locks_jax(podman_env, base, build_setup, minor, containers,
                                                             tmp_path):
    wheels, pip_conf = build_setup
    lock = build.read_lock(LOCK)
    standin = _standin_colocated_base(podman_env, base, LOCK, lock.jax, wheels, pip_conf, tmp_path)
    built = oci.build_images(podman_env, lock=LOCK, base=base, wheels=wheels, pip_conf=pip_conf, minor=minor,
                             colocated_base=standin)
    ref = built.refs["colocated-sidecar"]
    labels = oci.labels(podman_env, ref)
    assert labels["mtc.role"] == "colocated-sidecar" and labels["org.opencontainers.image.base.name"] == standin
    fp = _fingerprint(containers, ref)
    assert {k: str(fp[k]) for k in LABEL_KEYS} == {k: labels[v] for k, v in LABEL_KEYS.items()}
    out = containers.run(ref, "-c", "import mtc.sidecar.service, mtc.sidecar.colocated; print('ok')",
                         entrypoint="python")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    check = _mtc("images", "check", "--engine", "podman", built.refs["head"], ref, env=podman_env)
    assert check.returncode == 0, check.stdout + check.stderr


def test_colocated_build_refuses_a_base_whose_jax_is_not_the_locks(podman_env, base, build_setup, minor, tmp_path):
    """A base tagged with the lock's jax that holds another one: build.py's tag check passes, and
    the Dockerfile's first step, which looks at what the base really has installed, refuses it."""
    wheels, pip_conf = build_setup
    lock = build.read_lock(LOCK)
    skew_lock = oci.skew_lock(LOCK, SKEW_JAX)
    standin = _standin_colocated_base(podman_env, base, skew_lock, lock.jax, oci.ensure_wheels(skew_lock, minor),
                                      pip_conf, tmp_path)
    built = oci.build_images(podman_env, lock=LOCK, base=base, wheels=wheels, pip_conf=pip_conf, minor=minor,
                             colocated_base=standin, check=False)
    assert "the colocated base differs from requirements.lock" in built.output, built.output[-3000:]
    assert f"jax: base {SKEW_JAX}, lock '{lock.jax}'" in built.output
    assert f"error: podman build of {built.refs['colocated-sidecar']} failed" in built.output


def test_images_check_refuses_a_tag_that_lies_about_the_labels_and_an_unknown_image(podman_env, images):
    lock = build.read_lock(LOCK)
    liar = images["sidecar"].rsplit(":", 1)[0] + f":{lock.mtc}-python_{lock.python}-jax_{SKEW_JAX}"
    oci.podman(podman_env, "tag", images["sidecar"], liar)
    try:
        out = _mtc("images", "check", "--engine", "podman", images["head"], liar, env=podman_env)
        assert out.returncode == 1, out.stdout + out.stderr
        assert (f"the sidecar image {liar} is tagged with other versions than its labels say "
                f"(jax: tag {SKEW_JAX}, label {lock.jax})") in out.stderr
        # Without --engine only the tags are compared: the same pair is refused for the tags alone.
        assert _mtc("images", "check", images["head"], liar, env=podman_env).returncode == 1
    finally:
        oci.podman(podman_env, "untag", images["sidecar"], liar, check=False)
    missing = images["head"].rsplit(":", 1)[0] + f":{lock.mtc}-python_{lock.python}-jax_0.0.1"
    out = _mtc("images", "check", "--engine", "podman", missing, images["sidecar"], env=podman_env)
    assert out.returncode == 2 and f"podman has no image {missing}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
