"""`mtc manifests render`: the JobSet of a Pathways job with mtc, validated against real schemas.

Every rendered JobSet is validated against the JobSet CRD's v1alpha2 openAPIV3Schema (vendored
in tests/data/k8s, shipped with `mtc manifests check`), made strict: an unknown field fails, where the API server would silently
drop it. Pod templates (wrapped as Pods and Jobs) and the Secret are validated with
kubernetes-validate in strict mode.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import stat

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mtc.head.tools.k8s import check as manifest_check, images, manifests, options as k8s_options
from mtc.head.tools.cli.main import main
from mtc.head.tools.k8s.manifests import render_documents
from mtc.head.tools.k8s.options import ManifestOptions
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit

K8S_VERSION = "1.32"  # GKE multi-tier checkpointing needs 1.32.3 or later
TOKEN = "0123456789abcdef0123456789abcdef"
COMMAND = "python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b steps=100"
BASE = ["manifests", "render", "--name", "llama", "--base-output-directory", "gs://bucket/ckpt",
        "--command", COMMAND]


@pytest.fixture(scope="module")
def jobset_validator() -> jsonschema.Draft7Validator:
    """The strict validator `mtc manifests check` uses (its schema is the vendored CRD's:
    tests/unit/test_manifest_check.py compares them)."""
    return manifest_check.jobset_validator()


def options(**changes) -> ManifestOptions:
    values = dict(name="llama", command=COMMAND, base_output_directory="gs://bucket/ckpt",
                  params=8e9, peer_token=TOKEN)
    values.update(changes)
    return ManifestOptions(**values)


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def _pod_specs(js: dict) -> dict[str, dict]:
    return {rj["name"]: rj["template"]["spec"]["template"]["spec"] for rj in js["spec"]["replicatedJobs"]}


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _head_command(js: dict) -> str:
    return _containers(_pod_specs(js)["pathways-head"])["main"]["command"][2]


def _command_flags(js: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for word in shlex.split(_head_command(js)):
        key, sep, value = word.partition("=")
        if sep:
            out.setdefault(key, []).append(value)
    return out


def validate_all(docs: list[dict], jobset_validator) -> None:
    """Every document against its schema: the JobSet CRD, and Kubernetes' own for the rest."""
    for doc in docs:
        if doc["kind"] == "JobSet":
            errors = sorted(jobset_validator.iter_errors(doc), key=lambda e: list(e.path))
            assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
            for rj in doc["spec"]["replicatedJobs"]:
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]},
                       "spec": rj["template"]["spec"]}
                kubernetes_validate.validate(job, K8S_VERSION, strict=True)
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": rj["name"]},
                       "spec": rj["template"]["spec"]["template"]["spec"]}
                kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ------------------------------------------------------------------ rendering and validation


def test_defaults_render_and_validate(jobset_validator):
    docs = render_documents(options())
    assert [d["kind"] for d in docs] == ["Secret", "JobSet"]  # the Secret first: kubectl apply order
    validate_all(docs, jobset_validator)
    js = docs[1]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    head, worker = js["spec"]["replicatedJobs"]
    assert (head["name"], head["replicas"]) == ("pathways-head", 1)
    # ct5p-hightpu-4t, 2x2x4: 16 chips, 4 per host -> 4 hosts; one slice.
    assert worker["replicas"] == 1
    assert worker["template"]["spec"]["parallelism"] == worker["template"]["spec"]["completions"] == 4
    pod = _pod_specs(js)["worker"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x4"}
    assert _containers(pod)["pathways-worker"]["resources"]["limits"]["google.com/tpu"] == 4


@pytest.mark.parametrize("changes", [
    dict(gke_mtc_enabled=True, params=None),
    dict(compute_type="ct6e-standard-4t", topology="8x16", num_slices=4, ramdisk_size="200Gi"),
    dict(compute_type="ct5lp-hightpu-8t", topology="2x4", namespace="training"),
    dict(compute_type="ct5p-hightpu-4t", topology="4x8x8", backup_interval_steps=100),
    dict(peer_token="", peer_token_secret="team-mtc-token"),
    dict(image="gcr.io/p/maxtext-mtc:x", sidecar_image="gcr.io/p/sidecar@sha256:" + "a" * 64),
])
def test_variants_validate(changes, jobset_validator):
    validate_all(render_documents(options(**changes)), jobset_validator)


def test_the_validators_can_fail(jobset_validator):
    """A JobSet with an unknown or mistyped field, or a bad pod, must not pass."""
    js = render_documents(options())[1]
    unknown = copy.deepcopy(js)
    unknown["spec"]["replicatedJobs"][1]["replica"] = 2
    wrong_type = copy.deepcopy(js)
    wrong_type["spec"]["replicatedJobs"][1]["replicas"] = "two"
    bad_volume = copy.deepcopy(js)
    _pod_specs(bad_volume)["worker"]["volumes"][1]["emptyDir"]["medium"] = {"Memory": True}
    for doc in (unknown, wrong_type, bad_volume):
        with pytest.raises(AssertionError):
            validate_all([doc], jobset_validator)
    bad_pod = copy.deepcopy(js)
    _containers(_pod_specs(bad_pod)["worker"])["colocated-python-sidecar"]["volumeMount"] = []
    with pytest.raises(AssertionError):  # the CRD schema has the pod spec too
        validate_all([bad_pod], jobset_validator)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w"},
           "spec": _pod_specs(bad_pod)["worker"]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_same_options_same_yaml():
    assert manifests.to_yaml(render_documents(options())) == manifests.to_yaml(render_documents(options()))


# ------------------------------------------------------------------ ramdisk


def _size_json(capsys, params: str, hosts: int) -> dict:
    assert main(["size", "--params", params, "--hosts", str(hosts), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("params, compute_type, topology, hosts", [
    ("70e9", "ct5p-hightpu-4t", "4x4x8", 32),  # the guide's example: 57Gi
    ("8e9", "ct6e-standard-4t", "4x4", 4),
    ("1e6", "ct5lp-hightpu-8t", "2x4", 1),
])
def test_empty_dir_size_limit_is_mtc_size(capsys, params, compute_type, topology, hosts):
    expected = _size_json(capsys, params, hosts)["size_limit"]
    assert main([*BASE, "--params", params, "--compute-type", compute_type, "--topology", topology]) == 0
    js = _by_kind(list(yaml.safe_load_all(capsys.readouterr().out)))["JobSet"]
    assert js["spec"]["replicatedJobs"][1]["template"]["spec"]["parallelism"] == hosts
    (volume,) = [v for v in _pod_specs(js)["worker"]["volumes"] if v["name"] == "mtc-ramdisk"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": expected}
    if params == "70e9":
        assert expected == "57Gi"


def test_given_ramdisk_size_is_used_when_big_enough():
    js = render_documents(options(params=70e9, topology="4x4x8", ramdisk_size="60Gi"))[1]
    assert _pod_specs(js)["worker"]["volumes"][1]["emptyDir"]["sizeLimit"] == "60Gi"


def test_gke_mtc_enabled_uses_the_csi_driver():
    js = render_documents(options(gke_mtc_enabled=True, params=None))[1]
    (volume,) = [v for v in _pod_specs(js)["worker"]["volumes"] if v["name"] == "mtc-ramdisk"]
    assert volume == {"name": "mtc-ramdisk", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}}


@pytest.mark.parametrize("how", ["default", "flag", "command"])
def test_ramdisk_is_mounted_at_local_checkpoint_directory_in_the_sidecar_only(how):
    o = {"default": options(),
         "flag": options(ramdisk_dir="/local/ckpt"),
         "command": options(command=COMMAND + " local_checkpoint_directory=/local/ckpt")}[how]
    js = render_documents(o)[1]
    (directory,) = _command_flags(js)["local_checkpoint_directory"]
    assert directory == ("/tmp/mtc_checkpoints" if how == "default" else "/local/ckpt")
    pods = _pod_specs(js)
    mounts = {(job, name): {m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == "mtc-ramdisk"}
              for job, pod in pods.items() for name, c in _containers(pod).items()}
    # The sidecar writes, replicates and backs up; the head (a CPU node) and the Pathways
    # worker binary never touch the ramdisk.
    assert mounts.pop(("worker", "colocated-python-sidecar")) == {directory}
    assert all(not m for m in mounts.values()), mounts
    assert "mtc-ramdisk" not in {v["name"] for v in pods["pathways-head"].get("volumes", [])}


# ------------------------------------------------------------------ peer token


def test_token_lives_in_the_secret_and_is_referenced():
    secret, js = render_documents(options())
    assert secret["stringData"] == {"token": TOKEN}
    assert TOKEN not in json.dumps(js)
    sidecar = _containers(_pod_specs(js)["worker"])["colocated-python-sidecar"]
    (env,) = [e for e in sidecar["env"] if e["name"] == "MTC_PEER_TOKEN"]
    assert env == {"name": "MTC_PEER_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "token"}}}
    head = _containers(_pod_specs(js)["pathways-head"])
    # The head's main container reads it too: its job key signs and checks the compilation cache's entries.
    assert [e for e in head["main"]["env"] if e["name"] == "MTC_PEER_TOKEN"] == [env]
    assert all("MTC_PEER_TOKEN" not in json.dumps(c) for name, c in head.items() if name != "main")


def test_existing_secret_renders_no_secret():
    docs = render_documents(options(peer_token="", peer_token_secret="team-token"))
    assert [d["kind"] for d in docs] == ["JobSet"]
    sidecar = _containers(_pod_specs(docs[0])["worker"])["colocated-python-sidecar"]
    assert {"name": "team-token", "key": "token"} in [
        e.get("valueFrom", {}).get("secretKeyRef") for e in sidecar["env"]]


def test_generated_token_differs_and_is_the_only_difference(capsys):
    outs = []
    for _ in range(2):
        assert main(list(BASE) + ["--params", "8e9"]) == 0
        outs.append(capsys.readouterr().out)
    tokens = [re.search(r"token: (\w+)", o)[1] for o in outs]
    assert tokens[0] != tokens[1] and all(len(t) == 64 for t in tokens)
    assert outs[0].replace(tokens[0], "T") == outs[1].replace(tokens[1], "T")


def test_token_file_goes_into_the_secret(tmp_path, capsys):
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert main([*BASE, "--params", "8e9", "--peer-token-file", str(tmp_path / "token")]) == 0
    secret = _by_kind(list(yaml.safe_load_all(capsys.readouterr().out)))["Secret"]
    assert secret["stringData"]["token"] == TOKEN


def test_min_token_length_matches_the_sidecar():
    from mtc.shared import config  # what the render reads (plan.py, render.py)
    from mtc.sidecar.peer import ENV_TOKEN, MIN_TOKEN_CHARS

    assert (config.MIN_TOKEN_CHARS, config.ENV_TOKEN) == (MIN_TOKEN_CHARS, ENV_TOKEN)
    with pytest.raises(ConfigError, match="at least 16"):
        render_documents(options(peer_token="short"))


# ------------------------------------------------------------------ the head command


def test_maxtext_flags_are_appended_to_the_head_command():
    js = render_documents(options(num_slices=2, local_checkpoint_period=20, backup_interval_minutes=15))[1]
    assert _head_command(js).startswith(COMMAND + " ")
    flags = _command_flags(js)
    assert {k: v for k, v in flags.items() if k not in ("model_name", "steps")} == {
        "run_name": ["llama"], "base_output_directory": ["gs://bucket/ckpt"], "num_slices": ["2"],
        "enable_single_controller": ["true"], "enable_checkpointing": ["true"],
        "enable_multi_tier_checkpointing": ["true"], "colocated_python_checkpointing": ["true"],
        "local_checkpoint_directory": ["/tmp/mtc_checkpoints"], "local_checkpoint_period": ["20"],
        "multi_tier_checkpointing_backup_interval_minutes": ["15"]}
    assert js["spec"]["replicatedJobs"][1]["replicas"] == 2
    head = _containers(_pod_specs(js)["pathways-head"])
    assert "--instance_count=2" in head["pathways-rm"]["args"]
    assert {"name": "MTC_PEER_PORT", "value": "29010"} in head["main"]["env"]


def test_the_guides_command_is_kept_not_duplicated():
    guide = ("python3 -m maxtext.trainers.pre_train.train run_name=job base_output_directory=gs://b/out "
             "num_slices=2 enable_single_controller=True enable_multi_tier_checkpointing=True "
             "colocated_python_checkpointing=True local_checkpoint_directory=/tmp/mtc_checkpoints "
             "local_checkpoint_period=10 multi_tier_checkpointing_backup_interval_steps=50")
    js = render_documents(ManifestOptions(name="job", command=guide, params=8e9, peer_token=TOKEN,
                                          num_slices=2, ramdisk_dir="/tmp/mtc_checkpoints/"))[1]
    flags = _command_flags(js)
    assert all(len(v) == 1 for v in flags.values()), flags
    assert flags["enable_checkpointing"] == ["true"]  # the one flag the command lacked
    assert "multi_tier_checkpointing_backup_interval_minutes" not in flags  # steps were given
    assert js["spec"]["replicatedJobs"][1]["replicas"] == 2


def test_images_carry_the_versions():
    js = render_documents(options(image_registry="us-docker.pkg.dev/p/mtc/"))[1]
    tag = images.image_tag()
    assert re.fullmatch(r"\d+\.\d+\.\d+-python_\d+\.\d+-jax_\d+\.\d+\.\d+\S*", tag)
    pods = _pod_specs(js)
    assert _containers(pods["pathways-head"])["main"]["image"] == f"us-docker.pkg.dev/p/mtc/mtc-head:{tag}"
    sidecar = _containers(pods["worker"])["colocated-python-sidecar"]
    # The colocated sidecar image (images/build.py --colocated-base): Google's colocated Python
    # server with mtc; the container runs the image's own command, so none is set here.
    assert sidecar["image"] == f"us-docker.pkg.dev/p/mtc/mtc-colocated-sidecar:{tag}"
    assert "command" not in sidecar and "args" not in sidecar


def test_default_sidecar_image_is_the_colocated_one_that_images_build_tags():
    js = render_documents(options())[1]
    image = _containers(_pod_specs(js)["worker"])["colocated-python-sidecar"]["image"]
    assert image == f"mtc-colocated-sidecar:{images.image_tag()}"
    assert k8s_options.SIDECAR_IMAGE_NAME == "mtc-colocated-sidecar"


@pytest.mark.parametrize("image", [
    "mtc-sidecar:0.1.0-python_3.11-jax_0.10.2",
    "us-docker.pkg.dev/p/r/mtc-sidecar:0.1.0-python_3.11-jax_0.10.2",
    "localhost:5000/mtc-sidecar@sha256:" + "a" * 64,
    "r.io/mtc-sidecar",
])
def test_the_cluster_mode_daemon_image_is_refused_as_the_sidecar(image):
    """mtc-sidecar runs `python -m mtc.sidecar serve` (cluster mode); on Pathways it would start
    without its arguments and no colocated Python server would answer."""
    with pytest.raises(ConfigError) as e:
        render_documents(options(sidecar_image=image))
    msg = str(e.value)
    assert "--sidecar-image" in msg and "--pathways-colocated-python-sidecar-image" in msg
    assert "cluster-mode sidecar daemon image" in msg and "mtc-colocated-sidecar" in msg
    path = image.split("@")[0].rpartition("/")[0]
    assert f"e.g. {path + '/' if path else ''}mtc-colocated-sidecar" in msg  # the same registry, the right name


@pytest.mark.parametrize("image", ["r.io/mtc-sidecar-custom:1", "r.io/mtc-sidecar/colocated:1",
                                   "my-mtc-sidecar:1", "mtc-colocated-sidecar:1"])
def test_other_sidecar_images_are_accepted(image):
    js = render_documents(options(sidecar_image=image))[1]
    assert _containers(_pod_specs(js)["worker"])["colocated-python-sidecar"]["image"] == image


def test_peer_port_is_exposed_on_the_sidecar():
    js = render_documents(options(peer_port=31000))[1]
    ports = _containers(_pod_specs(js)["worker"])["colocated-python-sidecar"]["ports"]
    assert {"name": "mtc-peer", "containerPort": 31000, "protocol": "TCP"} in ports


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("extra, needle", [
    (["--params", "8e9", "--compute-type", "ct9-hightpu-4t"], "--compute-type"),
    (["--params", "8e9", "--topology", "3x3"], "--topology"),
    (["--params", "8e9", "--compute-type", "ct6e-standard-4t", "--topology", "2x2x2"], "--topology"),
    (["--params", "8e9", "--ramdisk-dir", "tmp/ckpt"], "--ramdisk-dir"),
    (["--params", "8e9", "--ramdisk-dir", "/tmp"], "--ramdisk-dir"),
    (["--params", "70e9", "--topology", "4x4x8", "--ramdisk-size", "40Gi"], "--ramdisk-size 57Gi"),
    (["--params", "8e9", "--ramdisk-size", "lots"], "--ramdisk-size"),
    (["--params", "8e9", "--gke-mtc-enabled"], "--gke-mtc-enabled"),
    ([], "--params"),
    (["--params", "8e9", "--ramdisk-dir", "/local", "--command", COMMAND + " local_checkpoint_directory=/x"],
     "--ramdisk-dir"),
    (["--params", "8e9", "--num-slices", "2", "--command", COMMAND + " num_slices=4"], "--num-slices"),
    (["--params", "8e9", "--command", COMMAND + " enable_multi_tier_checkpointing=false"],
     "enable_multi_tier_checkpointing"),
    (["--params", "8e9", "--backup-interval-minutes", "5",
      "--command", COMMAND + " multi_tier_checkpointing_backup_interval_steps=100"], "--backup-interval-minutes"),
    (["--params", "8e9", "--backup-interval-minutes", "5", "--backup-interval-steps", "100"],
     "--backup-interval-steps"),
    (["--params", "8e9", "--local-checkpoint-period", "0"], "--local-checkpoint-period"),
    (["--params", "8e9", "--local-checkpoint-period", "20", "--backup-interval-steps", "10"],
     "multi_tier_checkpointing_backup_interval_steps"),
    (["--params", "8e9", "--peer-port", "29001"], "--peer-port"),
    (["--params", "8e9", "--peer-port", "70000"], "--peer-port"),
    (["--params", "8e9", "--peer-token-secret", "a", "--peer-token-file", "/dev/null"], "--peer-token"),
    (["--params", "8e9", "--peer-token-secret", "Bad_Name"], "--peer-token-secret"),
    (["--params", "8e9", "--name", "Llama"], "--name"),
    (["--params", "8e9", "--name", "a" * 50], "--name"),
    (["--params", "8e9", "--base-output-directory", ""], "--base-output-directory"),
    (["--params", "8e9", "--base-output-directory", "/mnt/out"], "--pathways-gcs-location"),
    (["--params", "8e9", "--pathways-gcs-location", "/mnt/out"], "--pathways-gcs-location"),
    (["--params", "8e9", "--num-slices", "0"], "--num-slices"),
    (["--params", "8e9", "--command", COMMAND + " num_slices=two"], "--num-slices"),
    (["--params", "8e9", "--command", "  "], "--command"),
    (["--params", "8e9", "--command", "python3 'unbalanced"], "--command"),
    (["--params", "8e9", "--image", "h:0.1.0-python_3.11-jax_0.10.2",
      "--sidecar-image", "s:0.1.0-python_3.12-jax_0.10.2"], "--sidecar-image"),
    (["--params", "8e9", "--pathways-colocated-python-sidecar-image", "r.io/mtc-sidecar:1"],
     "--pathways-colocated-python-sidecar-image"),
])
def test_bad_input_exits_2_names_the_flag_writes_nothing(tmp_path, capsys, extra, needle):
    out = tmp_path / "job.yaml"
    assert main([*BASE, *extra, "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err
    assert list(tmp_path.iterdir()) == []


def test_unreadable_token_file_exits_2(tmp_path, capsys):
    assert main([*BASE, "--params", "8e9", "--peer-token-file", str(tmp_path / "missing")]) == 2
    assert "--peer-token-file" in capsys.readouterr().err


def test_render_without_a_token_asks_for_one():
    with pytest.raises(ConfigError, match="--peer-token-secret"):
        render_documents(options(peer_token=""))
    assert manifests.with_peer_token(options(peer_token="")).peer_token
    assert manifests.with_peer_token(options(peer_token="", peer_token_secret="s")).peer_token == ""


# ------------------------------------------------------------------ CLI


def test_help(capsys):
    assert main(["manifests", "render", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--gke-mtc-enabled", "--ramdisk-dir", "--params", "--peer-token-secret", "--output",
                 "--command", "--num-slices", "--topology"):
        assert flag in out
    assert main(["manifests"]) == 2  # the action is required
    assert "render" in capsys.readouterr().err


def test_output_file(tmp_path, capsys, jobset_validator):
    out = tmp_path / "job.yaml"
    assert main([*BASE, "--params", "8e9", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and str(out) in captured.err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # it holds the token
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [d["kind"] for d in docs] == ["Secret", "JobSet"]
    validate_all(docs, jobset_validator)
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]  # no temp file left behind


def test_mtc_launcher_runs_maxtext_through_mtc():
    js = render_documents(options(num_slices=2, local_checkpoint_period=20, backup_interval_minutes=15,
                                  mtc_launcher=True))[1]
    cmd = _head_command(js)
    assert cmd.startswith("python3 -m mtc.head.maxtext model_name=llama3.1-8b steps=100 ")
    assert "maxtext.trainers.pre_train.train" not in cmd
    assert _command_flags(js)["enable_multi_tier_checkpointing"] == ["true"]
    with pytest.raises(ConfigError, match="--mtc-launcher needs --command to run"):
        render_documents(options(command="python3 train.py", mtc_launcher=True))
    assert k8s_options.launcher_command("python3 -m mtc.head.maxtext a=1") == "python3 -m mtc.head.maxtext a=1"


def test_images_check_compares_the_tags(capsys):
    same = ("r/mtc-head:0.1.0-python_3.12-jax_0.12.0", "r/mtc-colocated-sidecar:0.1.0-python_3.12-jax_0.12.0")
    assert main(["images", "check", *same]) == 0
    assert "ok: the images carry the same" in capsys.readouterr().out
    assert main(["images", "check", "r/mtc-head:0.1.0-python_3.12-jax_0.12.0",
                 "r/mtc-colocated-sidecar:0.1.0-python_3.11-jax_0.10.2"]) == 1
    out, err = capsys.readouterr()
    assert "python   3.12" in out and "<- differs" in out and "python, jax" in err
    assert main(["images", "check", "r/mtc-head:latest", same[1]]) == 2
    assert "has no <mtc>-python_X.Y-jax_X.Y.Z tag" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="python: head 3.12, sidecar 3.11"):  # render uses the same check
        render_documents(options(image=same[0], sidecar_image="r/mtc-colocated-sidecar:0.1.0-python_3.11-jax_0.12.0"))


def test_images_check_with_an_engine_that_cannot_answer_is_an_error_naming_it(tmp_path):
    """--engine reads the labels from a local engine: one missing, or without its daemon (a docker
    CLI with no engine, as here), is a one-line error with the way out, never a traceback."""
    import subprocess
    import sys

    same = ("r/mtc-head:0.1.0-python_3.12-jax_0.12.0", "r/mtc-colocated-sidecar:0.1.0-python_3.12-jax_0.12.0")
    env = {"PATH": str(tmp_path)}  # no docker here at all
    out = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "images", "check", "--engine", "docker", *same],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "docker is not installed here; drop --engine" in out.stderr, out.stderr
    fake = tmp_path / "docker"  # a docker CLI whose engine does not answer
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "images", "check", "--engine", "docker", *same],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "--engine docker: docker does not answer here (Cannot connect" in out.stderr
    assert "Traceback" not in out.stderr


def test_preemption_budget_sets_the_pods_grace_period_and_the_heads_variable(capsys, tmp_path):
    js = _by_kind(render_documents(options(preemption_grace_s=50)))["JobSet"]
    pods = _pod_specs(js)
    assert pods and all(pod["terminationGracePeriodSeconds"] == 60 for pod in pods.values()), pods
    head_env = {e["name"]: e.get("value") for e in _containers(pods[k8s_options.HEAD_JOB])["main"]["env"]}
    assert head_env["MTC_PREEMPTION_GRACE_S"] == "50", head_env
    with pytest.raises(ConfigError, match="preemption-grace-s"):
        render_documents(options(preemption_grace_s=0))
    out = tmp_path / "js.yaml"
    assert main(["manifests", "render", "--name", "j", "--base-output-directory", "gs://b/p", "--params", "1e9",
                 "--command", "python3 -m maxtext.trainers.pre_train.train", "--preemption-grace-s", "-1",
                 "--output", str(out)]) != 0
    assert "preemption-grace-s" in capsys.readouterr().err
