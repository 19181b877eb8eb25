"""`mtc manifests check FILE`: a JobSet edited by hand, against the schemas and mtc's rules.

Each case starts from what `mtc manifests render` writes (which passes), changes one thing the
way a person editing the YAML would, and runs the real CLI on the file: the problem is one line
naming the place and the fix, and the exit status is 1.
"""

from __future__ import annotations

import copy
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtc.head.tools.k8s import check as manifest_check
from mtc.head.tools.cli.main import main
from mtc.head.tools.k8s.manifests import render_documents
from mtc.head.tools.k8s.options import ManifestOptions

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "tests" / "data" / "k8s" / "jobset-crd.yaml"
TOKEN = "0123456789abcdef0123456789abcdef"
TAG = "0.1.0-python_3.12-jax_0.12.0.1"
HEAD = f"r.io/p/mtc-head:{TAG}"
SIDECAR = f"r.io/p/mtc-colocated-sidecar:{TAG}"


def _docs(**changes) -> list[dict]:
    values = dict(name="llama", command="python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b",
                  base_output_directory="gs://bucket/ckpt", params=8e9, peer_token=TOKEN, image=HEAD,
                  sidecar_image=SIDECAR, ramdisk_dir="/local")
    values.update(changes)
    return render_documents(ManifestOptions(**values))


def _jobset(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "JobSet")


def _worker(docs: list[dict]) -> dict:
    return next(rj for rj in _jobset(docs)["spec"]["replicatedJobs"] if rj["name"] == "worker")["template"]["spec"]


def _sidecar(docs: list[dict]) -> dict:
    return next(c for c in _worker(docs)["template"]["spec"]["initContainers"] if c["name"] == "colocated-python-sidecar")


def _check(tmp_path, docs, *args: str, capsys) -> tuple[int, list[str], str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    rc = main(["manifests", "check", str(path), *args])
    out, err = capsys.readouterr()
    problems = [line for line in out.splitlines() if line.startswith(f"{path}: ")]
    return rc, [p[len(f"{path}: "):] for p in problems], err


def test_what_render_writes_passes(tmp_path, capsys):
    rc, problems, err = _check(tmp_path, _docs(), "--params", "8e9", capsys=capsys)
    assert (rc, problems) == (0, []), err


def test_the_examples_pass_with_their_existing_secret_named(capsys):
    for f in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        assert main(["manifests", "check", str(f), "--params", "8e9", "--peer-token-secret", "mtc-peer-token"]) == 0
        assert "ok:" in capsys.readouterr().out
        # Without saying that the Secret exists, the same file is refused: it is not in the file.
        assert main(["manifests", "check", str(f), "--params", "8e9"]) == 1
        out = capsys.readouterr().out
        assert "Secret mtc-peer-token (key token), which is not in the file" in out
        assert "--peer-token-secret mtc-peer-token" in out


@pytest.mark.parametrize("tag, what, head_has, sidecar_has", [
    ("0.1.0-python_3.12-jax_0.10.2", "jax", "0.12.0.1", "0.10.2"),
    ("0.1.0-python_3.11-jax_0.12.0.1", "python", "3.12", "3.11"),
])
def test_a_sidecar_image_with_other_versions_is_refused(tmp_path, capsys, tag, what, head_has, sidecar_has):
    docs = _docs()
    _sidecar(docs)["image"] = f"r.io/p/mtc-colocated-sidecar:{tag}"
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and len(problems) == 1, problems
    (p,) = problems
    assert "replicatedJob worker, container colocated-python-sidecar" in p
    assert f"has {what} {sidecar_has}, the head's {HEAD} has {what} {head_has}" in p
    assert "mtc images check" in p and "images/build.py build" in p


def test_an_image_without_version_tag_is_refused(tmp_path, capsys):
    docs = _docs()
    _sidecar(docs)["image"] = "r.io/p/mtc-colocated-sidecar:latest"
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and "has no <mtc>-python_X.Y-jax_X.Y.Z tag" in problems[0]


def test_the_daemon_image_as_colocated_sidecar_is_refused(tmp_path, capsys):
    docs = _docs()
    _sidecar(docs)["image"] = f"r.io/p/mtc-sidecar:{TAG}"
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and "cluster-mode daemon" in problems[0] and "mtc-colocated-sidecar" in problems[0]


def test_a_ramdisk_mounted_elsewhere_than_local_checkpoint_directory_is_refused(tmp_path, capsys):
    docs = _docs()
    for m in _sidecar(docs)["volumeMounts"]:
        if m["name"] == "mtc-ramdisk":
            m["mountPath"] = "/ramdisk"
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and len(problems) == 1, problems
    assert problems[0] == ("JobSet llama, replicatedJob worker, container colocated-python-sidecar: nothing is mounted "
                           "at local_checkpoint_directory=/local (the ramdisk volume mtc-ramdisk at /ramdisk): mount "
                           "the ramdisk at /local, or set local_checkpoint_directory=/ramdisk in the head's command")


def test_a_volume_at_the_path_that_is_no_ramdisk_is_refused(tmp_path, capsys):
    docs = _docs()
    pod = _worker(docs)["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "mtc-ramdisk"]
    vol.pop("emptyDir")
    vol["hostPath"] = {"path": "/mnt/disk"}
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and "volume mtc-ramdisk at /local is not a ramdisk" in problems[0]


def test_a_size_limit_below_mtc_size_is_refused(tmp_path, capsys):
    docs = _docs()
    (vol,) = [v for v in _worker(docs)["template"]["spec"]["volumes"] if v["name"] == "mtc-ramdisk"]
    assert vol["emptyDir"]["sizeLimit"] == "52Gi"  # mtc size --params 8e9 --hosts 4
    vol["emptyDir"]["sizeLimit"] = "40Gi"
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and len(problems) == 1, problems
    p = problems[0]
    assert "sizeLimit 40Gi (42.95 GB) of mtc-ramdisk is less than the" in p and "each of the 4 hosts per slice" in p
    assert p.endswith("needs for 8e09 parameters; mtc size --params 8e09 --hosts 4 gives sizeLimit: 52Gi"), p
    # Without --params the size cannot be judged: a note, and the file passes.
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 0 and problems == []


def test_a_memory_ramdisk_without_size_limit_is_refused(tmp_path, capsys):
    docs = _docs()
    (vol,) = [v for v in _worker(docs)["template"]["spec"]["volumes"] if v["name"] == "mtc-ramdisk"]
    del vol["emptyDir"]["sizeLimit"]
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and "has no sizeLimit" in problems[0] and "sizeLimit: 52Gi" in problems[0]


def test_a_missing_token_secret_is_refused_unless_named(tmp_path, capsys):
    docs = [d for d in _docs() if d["kind"] != "Secret"]
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", capsys=capsys)
    assert rc == 1 and len(problems) == 1, problems
    assert ("MTC_PEER_TOKEN comes from Secret llama-mtc-peer-token (key token), which is not in the file; add it "
            "(mtc manifests render writes one), or, if it exists in the cluster, say so with --peer-token-secret "
            "llama-mtc-peer-token") in problems[0]
    rc, problems, _ = _check(tmp_path, docs, "--params", "8e9", "--peer-token-secret", "llama-mtc-peer-token",
                             capsys=capsys)
    assert (rc, problems) == (0, [])


def test_a_secret_without_the_key_or_a_plain_token_is_refused(tmp_path, capsys):
    docs = _docs()
    secret = next(d for d in docs if d["kind"] == "Secret")
    secret["stringData"] = {"other": TOKEN}
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and "Secret llama-mtc-peer-token has no key 'token' (it has: other)" in problems[0]
    docs = _docs()
    env = _sidecar(docs)["env"]
    env[:] = [e if e["name"] != "MTC_PEER_TOKEN" else {"name": "MTC_PEER_TOKEN", "value": TOKEN} for e in env]
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and "MTC_PEER_TOKEN is not read from a Secret (its value is written in the JobSet" in problems[0]


def test_an_unknown_field_fails_the_jobset_schema_and_a_bad_secret_kubernetes_validate(tmp_path, capsys):
    docs = _docs()
    _jobset(docs)["spec"]["replicatedJobs"][0]["replica"] = 2  # misspelt: the API server would drop it
    secret = next(d for d in docs if d["kind"] == "Secret")
    secret["stringdata"] = secret.pop("stringData")
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1
    assert any(p.startswith("JobSet llama: spec.replicatedJobs[0]: Additional properties are not allowed "
                            "('replica' was unexpected) (JobSet CRD schema)") for p in problems), problems
    assert any(p.startswith("Secret llama-mtc-peer-token: ") and "'stringdata' was unexpected" in p
               and "kubernetes-validate" in p for p in problems), problems


def test_a_bad_pod_template_fails_kubernetes_validate(tmp_path, capsys):
    docs = _docs()
    _sidecar(docs)["volumeMount"] = _sidecar(docs).pop("volumeMounts")
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1
    assert any("replicatedJob worker: the pod template: " in p and "'volumeMount' was unexpected" in p
               for p in problems), problems
    # Without its mounts the sidecar has no ramdisk at local_checkpoint_directory either.
    assert any("nothing is mounted at local_checkpoint_directory=/local" in p for p in problems)


def test_several_problems_are_one_line_each(tmp_path, capsys):
    docs = [d for d in _docs() if d["kind"] != "Secret"]
    _sidecar(docs)["image"] = "r.io/p/mtc-colocated-sidecar:0.1.0-python_3.11-jax_0.10.2"
    rc, problems, err = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and len(problems) == 3, problems  # python, jax, the Secret
    assert "3 problem(s)" in err


def test_no_head_command_with_the_flags_is_refused(tmp_path, capsys):
    docs = _docs()
    head = _jobset(docs)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    head["command"] = ["/bin/bash", "-c", "python3 train.py"]
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and "no container runs MaxText with enable_multi_tier_checkpointing=true" in problems[0]


def test_unreadable_input_is_an_error_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: JobSet\n  spec: [\n")
    for args, rc, text in ((["manifests", "check", str(bad)], 1, "not valid YAML at line"),
                           (["manifests", "check", str(tmp_path / "missing.yaml")], 2, "cannot read"),
                           (["manifests", "check", str(bad), "--params", "-8e9"], 2, "must be more than 0")):
        out = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", *args], capture_output=True, text=True)
        assert out.returncode == rc, (args, out.stdout, out.stderr)
        assert text in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_render_piped_into_check(tmp_path):
    render = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "manifests", "render", "--name", "j",
                             "--base-output-directory", "gs://b/p", "--params", "8e9", "--command",
                             "python3 -m maxtext.trainers.pre_train.train", "--image", HEAD, "--sidecar-image",
                             SIDECAR], capture_output=True, text=True, check=True)
    out = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "manifests", "check", "-", "--params", "8e9"],
                         input=render.stdout, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok: standard input"), out.stdout + out.stderr


def test_the_packaged_jobset_schema_is_the_vendored_crds():
    """The schema the CLI ships (package data) is exactly the v1alpha2 schema of the CRD in tests/data/k8s."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    assert manifest_check.jobset_schema() == v["schema"]["openAPIV3Schema"]
    strict = manifest_check.strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    assert strict["properties"]["spec"]["additionalProperties"] is False
    assert gzip.decompress((REPO / "head" / "tools" / "k8s" / "schemas" / manifest_check.SCHEMA_FILE).read_bytes()) == \
        json.dumps(v["schema"]["openAPIV3Schema"], separators=(",", ":"), sort_keys=True).encode()


def test_an_unknown_core_kind_is_refused_and_a_custom_resource_is_a_note(tmp_path, capsys):
    docs = _docs() + [{"apiVersion": "v1", "kind": "Secrte", "metadata": {"name": "x"}},
                      {"apiVersion": "checkpointing.gke.io/v1", "kind": "CheckpointConfiguration",
                       "metadata": {"name": "c"}, "spec": {}}]
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and len(problems) == 1 and problems[0].startswith("Secrte x: Couldn't find schema"), problems
    path = tmp_path / "job.yaml"
    main(["manifests", "check", str(path)])
    assert "note: CheckpointConfiguration c: checkpointing.gke.io/v1 is a custom resource" in capsys.readouterr().out


def _head(docs: list[dict]) -> dict:
    return _jobset(docs)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.replace("model_name=llama3.1-8b", "..."), "holds '...', which stands for something left out"),
    (lambda c: c.replace("run_name=", "runname="), "sets no run_name=..."),
    (lambda c: c.replace("base_output_directory=", "base_output_dir="), "sets no base_output_directory=..."),
    (lambda c: c + " local_checkpoint_directory=/elsewhere", "sets local_checkpoint_directory twice (/local and /elsewhere)"),
])
def test_a_head_command_that_cannot_run_as_written_is_refused(tmp_path, capsys, edit, says):
    docs = _docs()
    head = _head(docs)
    words = head["command"][-1]
    head["command"][-1] = edit(words)
    assert head["command"][-1] != words
    rc, problems, _ = _check(tmp_path, docs, capsys=capsys)
    assert rc == 1 and any(says in p for p in problems), problems


def test_render_refuses_a_placeholder_in_the_command(capsys):
    assert main(["manifests", "render", "--name", "j", "--base-output-directory", "gs://b/p", "--params", "8e9",
                 "--command", "..."]) == 2
    assert "stands for something left out" in capsys.readouterr().err
