"""`mtc manifests render` wires TLS in transit by default: the job's TLS Secret is mounted read-only in
the head and the sidecar, MTC_TLS_DIR names it, and the documents still pass every check; --no-tls
renders none of it."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from mtc.head.tools.k8s import check as manifest_check
from mtc.head.tools.cli.main import main
from mtc.head.tools.k8s.manifests import render_documents
from mtc.head.tools.k8s.options import ManifestOptions
from mtc.shared import tls

pytestmark = pytest.mark.unit

COMMAND = "python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b steps=100"
MOUNT = "/etc/mtc/tls"


def render(**kw) -> list[dict]:
    return render_documents(ManifestOptions(name="llama", command=COMMAND, base_output_directory="gs://bucket/ckpt",
                                            params=8e9, peer_token="0123456789abcdef0123456789abcdef", **kw))


def _pods(js: dict) -> dict[str, dict]:
    return {rj["name"]: rj["template"]["spec"]["template"]["spec"] for rj in js["spec"]["replicatedJobs"]}


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _tls_use(js: dict) -> dict[tuple[str, str], tuple]:
    """(job, container) -> (MTC_TLS_DIR, the mounts of volume mtc-tls) for the containers that have either."""
    out = {}
    for job, pod in _pods(js).items():
        for name, c in _containers(pod).items():
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            mounts = [m for m in c.get("volumeMounts", []) if m["name"] == "mtc-tls"]
            if tls.ENV_TLS_DIR in env or mounts:
                out[(job, name)] = (env.get(tls.ENV_TLS_DIR), mounts)
    return out


def test_tls_is_on_by_default_in_the_head_and_the_sidecar_only_and_the_documents_pass_the_checks():
    docs = render()
    assert [d["kind"] for d in docs] == ["Secret", "JobSet"]  # the TLS Secret holds a key: made beforehand
    js = docs[1]
    mount = [{"name": "mtc-tls", "mountPath": MOUNT, "readOnly": True}]
    assert _tls_use(js) == {("pathways-head", "main"): (MOUNT, mount),
                            ("worker", "colocated-python-sidecar"): (MOUNT, mount)}
    for pod in _pods(js).values():
        (volume,) = [v for v in pod["volumes"] if v["name"] == "mtc-tls"]
        # Owner-only files: a tls.key that others can read is refused (mtc.shared.tls), as 0644 is.
        assert volume == {"name": "mtc-tls", "secret": {"secretName": "llama-mtc-tls", "defaultMode": 0o400}}
    report = manifest_check.check_documents(docs, params=8e9)
    assert report.problems == [], report
    for rj in js["spec"]["replicatedJobs"]:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": rj["name"]},
               "spec": rj["template"]["spec"]["template"]["spec"]}
        kubernetes_validate.validate(pod, "1.32", strict=True)


def test_no_tls_renders_no_secret_volume_and_no_variable():
    docs = render(tls=False)
    js = docs[1]
    assert _tls_use(js) == {}
    assert "mtc-tls" not in json.dumps(js) and tls.ENV_TLS_DIR not in json.dumps(js)
    assert manifest_check.check_documents(docs, params=8e9).problems == []


def test_the_cli_renders_tls_unless_no_tls(tmp_path, capsys):
    base = ["manifests", "render", "--name", "llama", "--base-output-directory", "gs://bucket/ckpt",
            "--params", "8e9", "--command", COMMAND]
    for extra, on in (([], True), (["--no-tls"], False)):
        out = tmp_path / f"job{len(extra)}.yaml"
        assert main([*base, *extra, "--output", str(out)]) == 0
        js = [d for d in yaml.safe_load_all(out.read_text()) if d["kind"] == "JobSet"][0]
        assert bool(_tls_use(js)) is on


def test_the_secret_keys_are_what_the_sidecars_read(tmp_path):
    """The README's `kubectl create secret generic ... --from-file=` keys become the mounted file names."""
    for name in (tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE):
        (tmp_path / name).write_text("x")
    files = tls.TLSFiles.in_dir(tmp_path)
    assert {p.rsplit("/", 1)[1] for p in (files.ca, files.cert, files.key)} == {"ca.crt", "tls.crt", "tls.key"}
