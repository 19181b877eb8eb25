"""The documents of ``mtc manifests render``, built from a ``Plan``: the peer-token Secret and the
JobSet (the Pathways head job and one worker job per slice, with their containers and volumes)."""

from __future__ import annotations

import math
import shlex
from typing import Any

from mtc.shared.config import ENV_TOKEN
from mtc.shared.tls import ENV_TLS_DIR

from mtc.head.tools.k8s.options import (COLOCATED_PYTHON_PORT, CSI_DRIVER, HEAD_JOB, JOBSET_API, PATHWAYS_REGISTRY,
                                             PODMONITORING_API, PROXY_PORT, RAMDISK_VOLUME, RM_PORT, SIDECAR_CONTAINER,
                                             TLS_MOUNT, TLS_VOLUME, TOKEN_KEY, WORKER_JOB, WORKER_PORT, Plan,
                                             launcher_command, topology_chips)


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


def pod_monitoring(p: Plan) -> dict:
    """The PodMonitoring that has GKE's managed Prometheus scrape the head's ``/metrics`` (the port named
    ``metrics`` of its main container; ``--metrics-port``). Managed collection ignores scrape annotations."""
    return {
        "apiVersion": PODMONITORING_API,
        "kind": "PodMonitoring",
        "metadata": _metadata(p, f"{p.options.name}-mtc-metrics"),
        "spec": {
            "selector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": p.options.name,
                                         "jobset.sigs.k8s.io/replicatedjob-name": HEAD_JOB}},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "30s"}],
            "targetLabels": {"metadata": ["pod", "container", "node"]},
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
        "containers": [_with_tls(p, _main(p))],
    }
    if p.tls_secret_name:
        pod["volumes"] = [tls_volume(p)]
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
        "initContainers": [_with_tls(p, _sidecar(p))],
        "containers": [_worker(p)],
        "volumes": [
            {"name": "shared-tmp", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}},
            ramdisk_volume(p),
            *([tls_volume(p)] if p.tls_secret_name else []),
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


def tls_volume(p: Plan) -> dict:
    """The job's TLS Secret (made beforehand: ``mtc tls generate`` then ``kubectl create secret generic``),
    its files readable by their owner only (``defaultMode: 0400``; a pod's ``fsGroup`` adds its group's
    read): mtc refuses a ``tls.key`` that others can read (``mtc.shared.tls``), as the default 0644 is."""
    return {"name": TLS_VOLUME, "secret": {"secretName": p.tls_secret_name, "defaultMode": 0o400}}


def _with_tls(p: Plan, container: dict) -> dict:
    """``container`` with the TLS Secret mounted read-only and ``MTC_TLS_DIR`` naming it (when TLS is on)."""
    if p.tls_secret_name:
        container["env"].append({"name": ENV_TLS_DIR, "value": TLS_MOUNT})
        container["volumeMounts"] = [*container.get("volumeMounts", []),
                                     {"name": TLS_VOLUME, "mountPath": TLS_MOUNT, "readOnly": True}]
    return container


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
    main = {
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
            # The job key (derived from the token) signs and checks the compilation cache's entries: the head
            # loads only executables this job wrote (docs/architecture.md, "What mtc trusts").
            {"name": ENV_TOKEN, "valueFrom": {"secretKeyRef": {"name": p.secret_name, "key": TOKEN_KEY}}},
        ],
    }
    if p.options.metrics_port:  # scraped through the PodMonitoring (pod_monitoring)
        main["env"].append({"name": "MTC_METRICS_PORT", "value": str(p.options.metrics_port)})
        # Every interface, said explicitly: the PodMonitoring scrapes the pod's IP (the node's, on the host
        # network), and kubectl port-forward reaches the pod on 127.0.0.1.
        main["env"].append({"name": "MTC_METRICS_ADDRESS", "value": "0.0.0.0"})
        main["ports"] = [{"name": "metrics", "containerPort": p.options.metrics_port}]
    return main


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
        "resources": {"limits": {"google.com/tpu": min(p.machine.chips_per_host, topology_chips(p.options.topology))}},
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
