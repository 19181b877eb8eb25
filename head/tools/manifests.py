"""Kubernetes manifests for a Pathways job that checkpoints with mtc (README, "Kubernetes (JobSet)").

``render_documents(options)`` builds, as plain dicts, what ``kubectl apply -f`` needs:

- a ``Secret`` holding the peer token (unless ``peer_token_secret`` names an existing one);
- a ``JobSet`` (``jobset.x-k8s.io/v1alpha2``) shaped like the ones PathwaysJob and Cluster
  Toolkit create: a ``pathways-head`` job (Pathways resource manager and proxy as native
  sidecars, and the user's training command with the MaxText multi-tier flags), and a
  ``worker`` job per slice (the Pathways worker on the TPUs, and the colocated Python sidecar
  running the mtc colocated sidecar image: Google's colocated Python server with mtc in it).

Decisions worth knowing:

- The ramdisk is mounted at ``local_checkpoint_directory`` in the colocated Python sidecar
  only: that is the process that writes, replicates and backs up checkpoints. The head runs
  on a CPU node and never touches a ramdisk; the Pathways worker binary does not either.
- The sidecar gets the token from the Secret (``MTC_PEER_TOKEN`` via ``secretKeyRef``); the
  token never appears in the JobSet, and the head does not get it at all.
- MaxText flags may be written in ``--command`` (as the guide does) or given as render
  options; a flag given both ways with different values is an error, never a silent choice.
  mtc's own settings (``peer_port``) go to the head as ``MTC_*`` environment variables, so
  that MaxText's flag parser never sees a key it does not know.
- Everything here is pure: the same options give the same documents. The one exception is
  a token generated when none is given (``with_peer_token``). YAML is produced at the edge
  (``to_yaml``), and needs PyYAML (``pip install 'mtc[k8s]'``).

Error messages name the ``mtc manifests render`` flag to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import re
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any

from mtc.shared.config import ENV_TOKEN, MIN_TOKEN_CHARS, MTCConfig
from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes, ramdisk_size

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
PATHWAYS_REGISTRY = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways"
TOKEN_KEY = "token"
RAMDISK_VOLUME = "mtc-ramdisk"
HEAD_JOB = "pathways-head"
WORKER_JOB = "worker"
SIDECAR_CONTAINER = "colocated-python-sidecar"
# images/build.py's names: the worker-side container runs the Pathways colocated Python server
# with mtc installed (its base image's own command), never the cluster-mode daemon image.
HEAD_IMAGE_NAME = "mtc-head"
SIDECAR_IMAGE_NAME = "mtc-colocated-sidecar"
DAEMON_IMAGE_NAME = "mtc-sidecar"

# Pathways' ports, as PathwaysJob uses them; the peer port must stay clear of them because
# the worker pods use the host's network.
PROXY_PORT, RM_PORT, WORKER_PORT = 29000, 29001, 29005
COLOCATED_PYTHON_PORT = 50051
_RESERVED_PORTS = {PROXY_PORT: "Pathways proxy", RM_PORT: "Pathways resource manager",
                   29002: "Pathways resource manager", WORKER_PORT: "Pathways worker",
                   29006: "Pathways worker", 8471: "TPU runtime", 8080: "TPU runtime metrics",
                   COLOCATED_PYTHON_PORT: "colocated Python sidecar"}
DEFAULT_PEER_PORT = 29010


@dataclass(frozen=True)
class Machine:
    """A GKE TPU machine type: Pathways instance name, node label, chips per host, topologies."""

    tpu_version: str
    accelerator: str
    chips_per_host: int
    topologies: frozenset[str] | None  # None: the v5p rule in _topology_ok


_V5E_V6E = frozenset({"2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"})
# Shapes GKE accepts for each machine type (the same table as PathwaysJob's).
MACHINES: dict[str, Machine] = {
    "ct6e-standard-4t": Machine("tpuv6e", "tpu-v6e-slice", 4, _V5E_V6E),
    "ct6e-standard-8t": Machine("tpuv6e1t", "tpu-v6e-slice", 8, frozenset({"2x4"})),
    "ct5lp-hightpu-4t": Machine("tpuv5e", "tpu-v5-lite-podslice", 4, _V5E_V6E),
    "ct5lp-hightpu-8t": Machine("tpuv5e1t", "tpu-v5-lite-podslice", 8, frozenset({"2x4"})),
    "ct5p-hightpu-4t": Machine("tpuv5", "tpu-v5p-slice", 4, None),
    "ct4p-hightpu-4t": Machine("tpuv4", "tpu-v4-podslice", 4, frozenset({
        "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "4x4x16", "8x8x8",
        "8x8x12", "8x8x16", "4x16x16", "8x16x16"})),
}
_V5P_SMALL = frozenset({"2x2x1", "2x2x2", "2x2x4", "2x4x4"})
_V5P_MAX_CHIPS = 8960


@dataclass(frozen=True)
class ManifestOptions:
    """What ``mtc manifests render`` needs; each field is the flag of the same name.

    MaxText flags (``ramdisk_dir`` is ``local_checkpoint_directory``) may also be written in
    ``command``; ``None`` means "take it from the command, else the default".
    """

    name: str
    command: str
    base_output_directory: str = ""
    namespace: str = ""
    run_name: str = ""
    compute_type: str = "ct5p-hightpu-4t"
    topology: str = "2x2x4"
    num_slices: int | None = None
    ramdisk_dir: str | None = None
    gke_mtc_enabled: bool = False
    params: float | None = None
    ramdisk_size: str = ""
    local_checkpoint_period: int | None = None
    backup_interval_minutes: int | None = None
    backup_interval_steps: int | None = None
    peer_port: int = DEFAULT_PEER_PORT
    peer_token: str = field(default="", repr=False)
    peer_token_secret: str = ""
    image: str = ""
    sidecar_image: str = ""
    image_registry: str = ""
    pathways_version: str = "latest"
    pathways_gcs_location: str = ""
    max_restarts: int = 4
    mtc_launcher: bool = False  # run MaxText's pre-training through python3 -m mtc.head.maxtext
    preemption_grace_s: float = 25.0  # SIGTERM to exit: the launcher's budget to save the step reached


MAXTEXT_TRAIN_MODULE = "maxtext.trainers.pre_train.train"
MTC_LAUNCHER_MODULE = "mtc.head.maxtext"


def launcher_command(command: str) -> str:
    """``command`` with ``-m maxtext.trainers.pre_train.train`` replaced by mtc's launcher."""
    pattern = re.compile(r"(-m\s+)" + re.escape(MAXTEXT_TRAIN_MODULE) + r"(?=\s|$)")
    if MTC_LAUNCHER_MODULE in command and not pattern.search(command):
        return command
    out, n = pattern.subn(r"\g<1>" + MTC_LAUNCHER_MODULE, command)
    if n != 1:
        raise ConfigError(f"--mtc-launcher needs --command to run 'python3 -m {MAXTEXT_TRAIN_MODULE}' once "
                          f"(found {n}); write the MaxText command as the guide does, or drop --mtc-launcher "
                          f"and call python3 -m {MTC_LAUNCHER_MODULE} yourself")
    return out


@dataclass(frozen=True)
class _Managed:
    """A MaxText flag the JobSet depends on: its render flag, option field and default."""

    key: str
    flag: str
    attr: str | None
    default: Any
    kind: type


# Order is the order the flags are appended to the command.
_MANAGED = (
    _Managed("run_name", "--run-name", "run_name", None, str),
    _Managed("base_output_directory", "--base-output-directory", "base_output_directory", None, str),
    _Managed("num_slices", "--num-slices", "num_slices", 1, int),
    _Managed("enable_single_controller", "", None, True, bool),
    _Managed("enable_checkpointing", "", None, True, bool),
    _Managed("enable_multi_tier_checkpointing", "", None, True, bool),
    _Managed("colocated_python_checkpointing", "", None, True, bool),
    _Managed("local_checkpoint_directory", "--ramdisk-dir", "ramdisk_dir", "/tmp/mtc_checkpoints", str),
    _Managed("local_checkpoint_period", "--local-checkpoint-period", "local_checkpoint_period", 10, int),
    _Managed("multi_tier_checkpointing_backup_interval_minutes", "--backup-interval-minutes",
             "backup_interval_minutes", 30, int),
    _Managed("multi_tier_checkpointing_backup_interval_steps", "--backup-interval-steps",
             "backup_interval_steps", None, int),
)


@dataclass(frozen=True)
class Plan:
    """The checked, derived values the documents are built from."""

    options: ManifestOptions
    machine: Machine
    hosts_per_slice: int
    num_slices: int
    flags: dict[str, str]  # every managed MaxText flag, as the job will see it
    appended: tuple[str, ...]  # the key=value items added to the command
    ramdisk_dir: str
    size_limit: str | None
    head_image: str
    sidecar_image: str
    pathways_gcs_location: str
    secret_name: str


# ---------------------------------------------------------------------- public API


def with_peer_token(options: ManifestOptions) -> ManifestOptions:
    """``options`` with a fresh random token when it needs a Secret and has no token."""
    if options.peer_token or options.peer_token_secret:
        return options
    return dataclasses.replace(options, peer_token=secrets.token_hex(32))


def plan(options: ManifestOptions) -> Plan:
    """Check ``options`` and derive everything the documents need; raises ConfigError."""
    o = options
    _check_label(o.name, "--name")
    if o.namespace:
        _check_label(o.namespace, "--namespace")
    machine, hosts = _slice_shape(o.compute_type, o.topology)
    flags, appended = _merge_flags(o)
    slices = int(flags["num_slices"]) if flags["num_slices"].strip().isdigit() else 0
    if slices < 1:
        raise ConfigError(f"num_slices={flags['num_slices']} must be a whole number >= 1 (the number of TPU "
                          "slices); give --num-slices 2, say")
    _check_name_length(o.name, slices, hosts)
    ramdisk_dir = _ramdisk_dir(flags["local_checkpoint_directory"])
    _check_config(flags, o.peer_port)
    if not o.preemption_grace_s > 0:
        raise ConfigError(f"--preemption-grace-s={o.preemption_grace_s:g} must be > 0 (seconds from a SIGTERM to the "
                          "exit, for saving the step reached)")
    if not 1 <= o.peer_port <= 65535:
        raise ConfigError(f"--peer-port={o.peer_port} is out of range; use 1..65535 "
                          f"(default {DEFAULT_PEER_PORT})")
    if o.peer_port in _RESERVED_PORTS:
        raise ConfigError(f"--peer-port={o.peer_port} is the {_RESERVED_PORTS[o.peer_port]}'s port "
                          f"on the same host network; pick another, e.g. {DEFAULT_PEER_PORT}")
    if o.max_restarts < 0:
        raise ConfigError(f"--max-restarts={o.max_restarts} must be >= 0")
    size_limit = _size_limit(o, hosts)
    if o.peer_token_secret and o.peer_token:
        raise ConfigError("--peer-token-secret and --peer-token-file are both given; use the existing "
                          "Secret (--peer-token-secret) or a token to put in a new one, not both")
    if o.peer_token_secret and (not _SUBDOMAIN.match(o.peer_token_secret) or len(o.peer_token_secret) > 253):
        raise ConfigError(f"--peer-token-secret={o.peer_token_secret!r} is not a valid Secret name: lowercase "
                          "letters, digits, '-' and '.', starting and ending with a letter or digit")
    if o.peer_token and (len(o.peer_token.strip()) < MIN_TOKEN_CHARS or o.peer_token != o.peer_token.strip()):
        raise ConfigError(f"the peer token (--peer-token-file) must be at least {MIN_TOKEN_CHARS} characters "
                          "without surrounding whitespace; e.g. python -c 'import secrets; "
                          "print(secrets.token_hex(32))'")
    gcs = o.pathways_gcs_location or flags["base_output_directory"]
    if not gcs.startswith("gs://"):
        source = "--pathways-gcs-location" if o.pathways_gcs_location else "base_output_directory"
        raise ConfigError(f"Pathways needs a gs:// scratch location, and {source} is {gcs!r}; "
                          "give --pathways-gcs-location gs://BUCKET/PATH")
    head_image, sidecar_image = _images(o)
    return Plan(options=o, machine=machine, hosts_per_slice=hosts, num_slices=slices, flags=flags,
                appended=appended, ramdisk_dir=ramdisk_dir, size_limit=size_limit,
                head_image=head_image, sidecar_image=sidecar_image,
                pathways_gcs_location=gcs.rstrip("/"),
                secret_name=o.peer_token_secret or f"{o.name}-mtc-peer-token")


def render_documents(options: ManifestOptions) -> list[dict]:
    """The Secret (when one is rendered) and the JobSet, as dicts, in ``kubectl apply`` order.

    Raises ConfigError when the options are inconsistent, or when a Secret is to be rendered
    and ``options.peer_token`` is empty (call ``with_peer_token`` first to generate one).
    """
    p = plan(options)
    docs: list[dict] = []
    if not options.peer_token_secret:
        if not options.peer_token:
            raise ConfigError("no peer token to put in the Secret: pass one (--peer-token-file), "
                              "reference an existing Secret (--peer-token-secret), or let "
                              "with_peer_token() generate one")
        docs.append(secret(p))
    docs.append(jobset(p))
    return docs


def to_yaml(documents: list[dict]) -> str:
    """Multi-document YAML, keys in build order (readable, and stable between runs)."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError("rendering manifests needs PyYAML: pip install 'mtc[k8s]'") from e
    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False, width=100)


def built_versions() -> dict:
    """{"mtc", "python", "jax"} of the images ``images/build.py`` builds: its lock's versions, which
    ``python images/build.py lock`` writes into ``image_versions.json`` (package data)."""
    from importlib import resources

    try:
        return json.loads(resources.files("mtc.head.tools").joinpath("image_versions.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"this mtc has no image_versions.json ({e}), so it cannot name the images that were "
                          "built; pass --image and --sidecar-image") from e


def image_tag(fp: dict | None = None) -> str:
    """``<mtc>-python_X.Y-jax_X.Y.Z``: the tag the build script gives every image (default: the
    versions of the images it builds, from its lock, not those of the environment this runs in).

    Pathways sidecar images carry python and jax in the tag the same way; head and sidecar
    must match exactly, and a tag that says so makes skew visible before anything runs.
    """
    fp = built_versions() if fp is None else fp
    return f"{fp['mtc']}-python_{fp['python']}-jax_{fp.get('jax') or 'none'}"


# ---------------------------------------------------------------------- documents


def secret(p: Plan) -> dict:
    """The Secret with the peer token, shared by every sidecar of the job."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(p, p.secret_name),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: p.options.peer_token},
    }


def jobset(p: Plan) -> dict:
    """The JobSet: the Pathways head job first (InOrder start-up), then the workers."""
    o = p.options
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(p, o.name),
        "spec": {
            # Pathways' head must be up before the workers register with it.
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            # A restart re-creates every pod; mtc restores from the ramdisks and peers.
            "failurePolicy": {"maxRestarts": o.max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [HEAD_JOB]},
            "coordinator": {"replicatedJob": HEAD_JOB, "jobIndex": 0, "podIndex": 0},
            "replicatedJobs": [head_job(p), worker_job(p)],
        },
    }


def head_job(p: Plan) -> dict:
    """One pod: Pathways resource manager and proxy (native sidecars) and the training command."""
    pod = {
        "restartPolicy": "OnFailure",
        "terminationGracePeriodSeconds": termination_grace(p),
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "initContainers": [_resource_manager(p), _proxy(p)],
        "containers": [_main(p)],
    }
    return _replicated_job(HEAD_JOB, 1, 1, 0, pod, exclusive="kubernetes.io/hostname")


def worker_job(p: Plan) -> dict:
    """One job per slice, one pod per host: the Pathways worker and the mtc sidecar."""
    pod = {
        # Restart containers in place: an emptyDir ramdisk lives as long as the pod, so a
        # crashed sidecar finds its checkpoints again; a new pod would start empty.
        "restartPolicy": "OnFailure",
        # The sidecars must outlive the head's preemption save (they write and copy it).
        "terminationGracePeriodSeconds": termination_grace(p),
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": p.machine.accelerator,
            "cloud.google.com/gke-tpu-topology": p.options.topology,
        },
        "initContainers": [_sidecar(p)],
        "containers": [_worker(p)],
        "volumes": [
            {"name": "shared-tmp", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}},
            ramdisk_volume(p),
        ],
    }
    hosts = p.hosts_per_slice
    return _replicated_job(WORKER_JOB, p.num_slices, hosts, 4 * hosts, pod,
                           exclusive="cloud.google.com/gke-nodepool")


def termination_grace(p: Plan) -> int:
    """The pods' ``terminationGracePeriodSeconds``: the launcher's preemption budget plus 10 s to exit."""
    return math.ceil(p.options.preemption_grace_s) + 10


def ramdisk_volume(p: Plan) -> dict:
    """The GKE multi-tier CSI volume (``--gke-mtc-enabled``), else a memory-backed emptyDir.

    The CSI volume outlives the pod (a JobSet restart finds the checkpoints in RAM); an
    emptyDir lives as long as its pod, so after a JobSet restart the first restore comes from
    the peers' and the backup's copies.
    """
    if p.options.gke_mtc_enabled:
        # Its size is the cluster's CheckpointConfiguration (inMemoryVolumeSize).
        return {"name": RAMDISK_VOLUME, "csi": {"driver": CSI_DRIVER}}
    return {"name": RAMDISK_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": p.size_limit}}


def head_command(p: Plan) -> str:
    """The training command with the MaxText flags it lacks appended (shell-quoted)."""
    command = p.options.command.strip()
    if p.options.mtc_launcher:
        command = launcher_command(command)
    return " ".join([command, *(shlex.quote(a) for a in p.appended)])


def _replicated_job(name: str, replicas: int, pods: int, backoff: int, pod: dict, *,
                    exclusive: str) -> dict:
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            # One job per node pool (slice) / per node (head): no two share hardware.
            "metadata": {"annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": exclusive}},
            "spec": {
                "parallelism": pods,
                "completions": pods,
                "completionMode": "Indexed",
                "backoffLimit": backoff,
                "template": {"spec": pod},
            },
        },
    }


def _metadata(p: Plan, name: str) -> dict:
    meta: dict[str, Any] = {"name": name}
    if p.options.namespace:
        meta["namespace"] = p.options.namespace
    meta["labels"] = {"app.kubernetes.io/name": "mtc", "app.kubernetes.io/instance": p.options.name}
    return meta


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


_COORDINATOR = "metadata.labels['jobset.sigs.k8s.io/coordinator']"


def _pathways_image(p: Plan, component: str) -> str:
    return f"{PATHWAYS_REGISTRY}/{component}:{p.options.pathways_version}"


def _resource_manager(p: Plan) -> dict:
    return {
        "name": "pathways-rm",
        "image": _pathways_image(p, "server"),
        "args": [f"--server_port={RM_PORT}", f"--gcs_scratch_location={p.pathways_gcs_location}",
                 "--node_type=resource_manager", f"--instance_count={p.num_slices}",
                 f"--instance_type={p.machine.tpu_version}:{p.options.topology}"],
        "env": [_field_env("HOST_ADDRESS", _COORDINATOR), {"name": "TPU_SKIP_MDS_QUERY", "value": "true"}],
        "ports": [{"containerPort": RM_PORT}, {"containerPort": 29002}],
        "resources": {"limits": {"cpu": "8", "memory": "16G"}},
        "restartPolicy": "Always",
    }


def _proxy(p: Plan) -> dict:
    return {
        "name": "pathways-proxy",
        "image": _pathways_image(p, "proxy_server"),
        "args": [f"--server_port={PROXY_PORT}", f"--resource_manager_address=$(PATHWAYS_HEAD):{RM_PORT}",
                 f"--gcs_scratch_location={p.pathways_gcs_location}"],
        "env": [_field_env("PATHWAYS_HEAD", _COORDINATOR)],
        "ports": [{"containerPort": PROXY_PORT}],
        "resources": {"limits": {"cpu": "16", "memory": "100G"}},
        "restartPolicy": "Always",
    }


def _main(p: Plan) -> dict:
    return {
        "name": "main",
        "image": p.head_image,
        "command": ["/bin/bash", "-c", head_command(p)],
        "env": [
            _field_env("PATHWAYS_HEAD", _COORDINATOR),
            {"name": "JAX_PLATFORMS", "value": "proxy"},
            {"name": "JAX_BACKEND_TARGET", "value": f"grpc://$(PATHWAYS_HEAD):{PROXY_PORT}"},
            {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
            # mtc's own setting: MaxText's flag parser would refuse peer_port=.
            {"name": "MTC_PEER_PORT", "value": str(p.options.peer_port)},
            {"name": "MTC_PREEMPTION_GRACE_S", "value": f"{p.options.preemption_grace_s:g}"},
        ],
    }


def _worker(p: Plan) -> dict:
    return {
        "name": "pathways-worker",
        "image": _pathways_image(p, "server"),
        "args": [f"--server_port={WORKER_PORT}", f"--resource_manager_address=$(PATHWAYS_HEAD):{RM_PORT}",
                 f"--gcs_scratch_location={p.pathways_gcs_location}"],
        "env": [
            {"name": "TPU_MIN_LOG_LEVEL", "value": "0"},
            {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "0"},
            {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
            _field_env("MEGASCALE_NUM_SLICES", "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"),
            _field_env("MEGASCALE_SLICE_ID", "metadata.labels['jobset.sigs.k8s.io/job-index']"),
            _field_env("PATHWAYS_HEAD", _COORDINATOR),
            _field_env("MEGASCALE_COORDINATOR_ADDRESS", _COORDINATOR),
        ],
        "ports": [{"containerPort": WORKER_PORT}, {"containerPort": 29006},
                  {"containerPort": 8471}, {"containerPort": 8080}],
        "volumeMounts": [{"name": "shared-tmp", "mountPath": "/tmp"}],
        "resources": {"limits": {"google.com/tpu": min(p.machine.chips_per_host, _chips(p.options.topology))}},
    }


def _sidecar(p: Plan) -> dict:
    """The colocated Python sidecar: mtc's SidecarService runs in it, one per host."""
    return {
        "name": SIDECAR_CONTAINER,
        "image": p.sidecar_image,
        "env": [
            {"name": "GRPC_SERVER_ADDRESS", "value": f"0.0.0.0:{COLOCATED_PYTHON_PORT}"},
            {"name": ENV_TOKEN,
             "valueFrom": {"secretKeyRef": {"name": p.secret_name, "key": TOKEN_KEY}}},
        ],
        "ports": [{"name": "colocated-py", "containerPort": COLOCATED_PYTHON_PORT},
                  {"name": "mtc-peer", "containerPort": p.options.peer_port, "protocol": "TCP"}],
        "volumeMounts": [{"name": "shared-tmp", "mountPath": "/tmp"},
                         {"name": RAMDISK_VOLUME, "mountPath": p.ramdisk_dir}],
        # A native sidecar: started before the worker, and kept running beside it.
        "restartPolicy": "Always",
    }


# ---------------------------------------------------------------------- checks


_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_label(value: str, flag: str) -> None:
    if not _LABEL.match(value) or len(value) > 63:
        raise ConfigError(f"{flag}={value!r} is not a valid name: use at most 63 lowercase letters, "
                          "digits and '-', starting with a letter and ending with a letter or digit")


def _check_name_length(name: str, slices: int, hosts: int) -> None:
    """The JobSet name is part of every pod's host name, which must fit in 63 characters."""
    longest = max(f"{name}-{HEAD_JOB}-0-0", f"{name}-{WORKER_JOB}-{slices - 1}-{hosts - 1}", key=len)
    if len(longest) > 63:
        room = 63 - (len(longest) - len(name))
        raise ConfigError(f"--name={name!r} is too long: pod host names such as {longest} must fit in "
                          f"63 characters; use at most {room} characters")


_SYSTEM_DIRS = frozenset({"/", "/tmp", "/dev", "/etc", "/usr", "/bin", "/lib", "/proc", "/sys", "/var", "/root"})


def _ramdisk_dir(path: str) -> str:
    """local_checkpoint_directory, normalised: the volume's mount path in the sidecar."""
    if not posixpath.isabs(path):
        raise ConfigError(f"--ramdisk-dir={path!r} is not an absolute path; the ramdisk is mounted there, "
                          "so give one like /tmp/mtc_checkpoints (it is also local_checkpoint_directory)")
    norm = posixpath.normpath(path)
    if norm in _SYSTEM_DIRS or norm.startswith(("/proc/", "/sys/")):
        raise ConfigError(f"--ramdisk-dir={path} would hide a directory the container needs; use a "
                          "directory of its own, e.g. /tmp/mtc_checkpoints")
    return norm


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def _topology_ok(machine: Machine, topology: str) -> bool:
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)+", topology):
        return False
    if machine.topologies is not None:
        return topology in machine.topologies
    dims = [int(d) for d in topology.split("x")]
    if len(dims) != 3:
        return False
    if topology in _V5P_SMALL:
        return True
    return dims == sorted(dims) and all(d % 4 == 0 for d in dims) and math.prod(dims) <= _V5P_MAX_CHIPS


def _slice_shape(compute_type: str, topology: str) -> tuple[Machine, int]:
    machine = MACHINES.get(compute_type)
    if machine is None:
        raise ConfigError(f"--compute-type={compute_type!r} is not a TPU machine type mtc knows; use one of "
                          f"{', '.join(MACHINES)}")
    if not _topology_ok(machine, topology):
        shapes = (", ".join(sorted(machine.topologies, key=_chips)) if machine.topologies is not None else
                  "2x2x1, 2x2x2, 2x2x4, 2x4x4, or AxBxC with A <= B <= C, each a multiple of 4")
        raise ConfigError(f"--topology={topology!r} is not a slice shape of {compute_type}; use one of {shapes}")
    hosts = max(1, _chips(topology) // machine.chips_per_host)
    return machine, hosts


def _command_flags(command: str) -> dict[str, str]:
    """The ``key=value`` items of the training command (last one wins, as in MaxText)."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ConfigError(f"--command cannot be parsed as a shell command ({e}); check its quotes") from None
    out: dict[str, str] = {}
    for w in words:
        key, sep, value = w.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            out[key] = value
    return out


def _same(kind: type, text: str, value: Any) -> bool:
    """Whether ``text`` from the command means ``value`` (``10`` is ``10``, ``True`` is ``true``)."""
    if kind is bool:
        return text.strip().lower() in ({"true", "1", "yes"} if value else {"false", "0", "no"})
    if kind is int:
        try:
            return int(text) == int(value)
        except ValueError:
            return False
    if text.startswith("/"):
        return posixpath.normpath(text) == posixpath.normpath(str(value))
    return text.rstrip("/") == str(value).rstrip("/")


def _merge_flags(o: ManifestOptions) -> tuple[dict[str, str], tuple[str, ...]]:
    """Every managed MaxText flag's value, and the ``key=value`` items the command lacks."""
    if not o.command.strip():
        raise ConfigError("--command is empty; give the training command, e.g. "
                          "--command 'python3 -m maxtext.trainers.pre_train.train TRAINING_ARGS'")
    given = _command_flags(o.command)
    backup_in_command = any(k in given for k in ("multi_tier_checkpointing_backup_interval_minutes",
                                                 "multi_tier_checkpointing_backup_interval_steps"))
    backup_in_options = o.backup_interval_minutes is not None or o.backup_interval_steps is not None
    flags: dict[str, str] = {}
    appended: list[str] = []
    for m in _MANAGED:
        option = getattr(o, m.attr) if m.attr else None
        if m.attr in ("run_name", "base_output_directory") and option == "":
            option = None
        if m.key in given:
            if option is not None and not _same(m.kind, given[m.key], option):
                raise ConfigError(f"--command sets {m.key}={given[m.key]} but {m.flag} is {option}; they must "
                                  f"agree: drop one of them")
            if m.attr is None and not _same(m.kind, given[m.key], m.default):
                raise ConfigError(f"--command sets {m.key}={given[m.key]}, but a JobSet rendered for mtc "
                                  f"needs {m.key}=true; remove it from --command")
            flags[m.key] = given[m.key]
            continue
        value = option
        if value is None:
            value = m.default
            if m.key == "run_name":
                value = o.name
            if m.key.startswith("multi_tier_checkpointing_backup") and (backup_in_command or backup_in_options):
                value = None  # the other interval is set: the two are exclusive
        if value is None:
            continue
        text = ("true" if value else "false") if m.kind is bool else str(value)
        flags[m.key] = text
        appended.append(f"{m.key}={text}")
    if "base_output_directory" not in flags or not flags["base_output_directory"].strip():
        raise ConfigError("base_output_directory is not set: give --base-output-directory gs://BUCKET/PATH "
                          "(backups go to <base_output_directory>/<run_name>/mtc) or put it in --command")
    return flags, tuple(appended)


def _check_config(flags: dict[str, str], peer_port: int) -> None:
    """The guide's rules on the merged flags, with the render flags named."""
    minutes = flags.get("multi_tier_checkpointing_backup_interval_minutes")
    steps = flags.get("multi_tier_checkpointing_backup_interval_steps")
    if minutes is not None and steps is not None:
        raise ConfigError("both backup intervals are set (--backup-interval-minutes and --backup-interval-steps, "
                          "or multi_tier_checkpointing_backup_interval_* in --command); they are exclusive: keep one")
    try:
        period = int(flags["local_checkpoint_period"])
    except ValueError:
        raise ConfigError(f"local_checkpoint_period={flags['local_checkpoint_period']!r} is not an integer; "
                          "give --local-checkpoint-period 10 (steps)") from None
    if period <= 0:
        raise ConfigError(f"local_checkpoint_period={period}: multi-tier checkpointing needs a period > 0; "
                          "give --local-checkpoint-period 10 (steps)")
    # The config itself is the last word (bad numbers, steps below the period, ...).
    known = [f"{k}={v}" for k, v in flags.items()]
    try:
        MTCConfig.from_flags(known, ignore_unknown=True, peer_port=peer_port if 0 < peer_port < 65536 else 0)
    except ConfigError as e:
        raise ConfigError(f"{e}\n(set these with the render flags --local-checkpoint-period, "
                          "--backup-interval-minutes/--backup-interval-steps, --ramdisk-dir, or in --command)") from None


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def parse_quantity(text: str) -> int:
    """Bytes in a Kubernetes quantity such as ``57Gi``, ``60G`` or ``1048576``; raises ConfigError."""
    m = _QUANTITY.match(text.strip())
    if not m:
        raise ConfigError(f"--ramdisk-size={text!r} is not a Kubernetes quantity; write it like 57Gi or 60G")
    number, unit = m.groups()
    whole, _, frac = number.partition(".")
    value = (int(whole) * 10**len(frac) + int(frac or 0)) * _UNITS[unit]
    return -(-value // 10**len(frac))


def _size_limit(o: ManifestOptions, hosts: int) -> str | None:
    """The emptyDir sizeLimit: given, or ``mtc size --params P --hosts H``; None with the CSI driver."""
    if o.gke_mtc_enabled:
        if o.params is not None or o.ramdisk_size:
            raise ConfigError("--params/--ramdisk-size size the emptyDir ramdisk; with --gke-mtc-enabled the "
                              "CSI driver's ramdisk size is the cluster's CheckpointConfiguration "
                              "(inMemoryVolumeSize): drop them here (use `mtc size` to choose that size)")
        return None
    if o.params is None and not o.ramdisk_size:
        raise ConfigError("the ramdisk needs a size: give --params (model parameters, e.g. 70e9) to compute it "
                          "as `mtc size` does, or --ramdisk-size (e.g. 57Gi), or use --gke-mtc-enabled")
    need = ramdisk_size(o.params, hosts) if o.params is not None else None
    if not o.ramdisk_size:
        return need.size_limit
    have = parse_quantity(o.ramdisk_size)
    if have <= 0:
        raise ConfigError(f"--ramdisk-size={o.ramdisk_size} must be more than 0")
    if need is not None and have < need.required_bytes:
        params = f"{o.params:.6g}".replace("e+", "e")  # 7e10, as --params accepts it
        raise ConfigError(
            f"--ramdisk-size={o.ramdisk_size} ({format_bytes(have)}) is too small for --params={params}: "
            f"each of the {hosts} hosts per slice needs {format_bytes(need.required_bytes)} "
            f"(mtc size --params {params} --hosts {hosts}); use --ramdisk-size {need.size_limit} or more, "
            "or drop --ramdisk-size to use that")
    return o.ramdisk_size.strip()


def _repository_name(ref: str) -> str:
    """The last path component of an image reference, without tag or digest:
    ``mtc-sidecar`` for ``registry:5000/p/mtc-sidecar:1.0@sha256:...``."""
    last = ref.split("@", 1)[0].rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


_TAG_VERSIONS = re.compile(r"-python_(\d+\.\d+)-jax_([0-9][0-9A-Za-z.]*)$")


def image_versions(ref: str) -> dict | None:
    """{"mtc", "python", "jax"} from an image reference's tag (``<mtc>-python_X.Y-jax_X.Y.Z``, as
    images/build.py tags every image; a Pathways sidecar tag ``<date>-python_X.Y-jax_X.Y.Z`` gives
    its date as "mtc"), or None when the tag does not carry them."""
    tag = ref.split("@", 1)[0].rsplit("/", 1)[-1].partition(":")[2]
    m = _TAG_VERSIONS.search(tag)
    if not m:
        return None
    return {"mtc": tag[: m.start()], "python": m[1], "jax": m[2]}


def image_mismatches(head: str, sidecar: str) -> list[tuple[str, str, str]]:
    """(what, head image's, sidecar image's) for each version the two tags disagree on.

    ConfigError when a tag does not carry its versions (nothing can be compared)."""
    hv, sv = image_versions(head), image_versions(sidecar)
    for ref, v in ((head, hv), (sidecar, sv)):
        if v is None:
            raise ConfigError(f"image {ref} has no <mtc>-python_X.Y-jax_X.Y.Z tag, so its versions cannot be "
                              "checked; use the tags images/build.py gives (python images/build.py tags)")
    return [(k, hv[k], sv[k]) for k in ("mtc", "python", "jax") if hv[k] != sv[k]]


def _images(o: ManifestOptions) -> tuple[str, str]:
    """Head and sidecar image references; both default to the images the build script builds (its lock)."""
    tag = image_tag()
    prefix = o.image_registry.rstrip("/") + "/" if o.image_registry else ""
    head = o.image or f"{prefix}{HEAD_IMAGE_NAME}:{tag}"
    sidecar = o.sidecar_image or f"{prefix}{SIDECAR_IMAGE_NAME}:{tag}"
    for flag, ref, name in (("--image", head, HEAD_IMAGE_NAME),
                            ("--sidecar-image", sidecar, SIDECAR_IMAGE_NAME)):
        if not ref.strip() or any(c.isspace() for c in ref):
            raise ConfigError(f"{flag}={ref!r} is not an image reference (e.g. registry/{name}:{tag})")
    if _repository_name(sidecar) == DAEMON_IMAGE_NAME:
        path, _, last = sidecar.split("@", 1)[0].rpartition("/")
        fixed = (path + "/" if path else "") + SIDECAR_IMAGE_NAME + last[len(DAEMON_IMAGE_NAME):]
        raise ConfigError(
            f"--sidecar-image (--pathways-colocated-python-sidecar-image) is {sidecar}, the cluster-mode sidecar "
            f"daemon image (python -m mtc.sidecar serve), which does not run the Pathways colocated Python "
            f"server; use the colocated sidecar image, e.g. {fixed} (python images/build.py build "
            "--colocated-base <pathways-colocated-python/sidecar image>), or drop the flag for the default "
            f"[--image-registry/]{SIDECAR_IMAGE_NAME}:<tag>")
    if image_versions(head) and image_versions(sidecar):  # the same check as `mtc images check`
        bad = image_mismatches(head, sidecar)
        if bad:
            raise ConfigError("--image and --sidecar-image differ: " + "; ".join(
                f"{k}: head {h}, sidecar {v}" for k, h, v in bad) + "; head and sidecar must run exactly the same "
                "mtc, python and jax: use images built together (same tag)")
    return head, sidecar
