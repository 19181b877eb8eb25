"""``mtc manifests check FILE``: is a hand-edited JobSet still one that mtc can run in?

``check_documents(docs)`` returns a ``Report``: each problem one line, naming the document,
the replicated job and container it is about, and the fix. Three kinds of checks:

- **schemas**: a JobSet against the JobSet CRD's ``v1alpha2`` schema (``schemas/`` in this
  package, extracted from the upstream CRD), made strict: a field the schema does not list is
  a problem (the API server would drop it without a word, so a misspelt key silently does
  nothing). Every other document, and every pod template wrapped as a ``batch/v1`` Job and a
  ``v1`` Pod, with ``kubernetes-validate`` in strict mode (its first error per document).
- **mtc's rules**, read through the ``kubernetes`` client's typed models (``V1PodSpec``,
  ``V1Secret``): the ramdisk is mounted in the sidecar at ``local_checkpoint_directory``; the
  sidecar image carries the head image's versions (the check of ``mtc images check``); the
  peer token's Secret is in the file or named with ``peer_token_secret``; a memory
  ``emptyDir`` has a ``sizeLimit`` of at least what ``mtc size`` gives (with ``params``);
  and what ``render`` refuses in its options, as a hand edit can break it: every pod's
  ``terminationGracePeriodSeconds`` above the head's ``MTC_PREEMPTION_GRACE_S``; ports in range
  and ``MTC_METRICS_PORT`` the head's port named ``metrics``, clear of the others; a PodMonitoring
  on the head's replicated job and a port it has; TLS (``MTC_TLS_DIR``) in the head and every
  sidecar or in none, where a Secret is mounted, the same Secret everywhere.
- What cannot be judged from the file (the CSI driver's size, a sizeLimit without ``params``)
  is a note, not a problem.

The head container is the one whose command sets ``local_checkpoint_directory`` or
``enable_multi_tier_checkpointing`` (``main`` in what ``mtc manifests render`` writes); the
sidecar containers are those in the other pods that run an mtc image or are named
``colocated-python-sidecar``.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import posixpath
import shlex
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from mtc.shared.config import ENV_TOKEN, MIN_TOKEN_CHARS
from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes, ramdisk_size

from mtc.head.tools.k8s.images import image_mismatches, image_versions
from mtc.head.tools.k8s.options import (CSI_DRIVER, DAEMON_IMAGE_NAME, HEAD_IMAGE_NAME, JOBSET_API, RESERVED_PORTS,
                                        SIDECAR_CONTAINER, SIDECAR_IMAGE_NAME)
from mtc.head.tools.k8s.plan import parse_quantity, placeholders

K8S_VERSION = "1.32"  # GKE's multi-tier checkpointing needs 1.32.3 or later
SCHEMA_FILE = "jobset-v1alpha2.schema.json.gz"
PODMONITORING_SCHEMA_FILE = "podmonitoring-v1.schema.json.gz"
_MTC_IMAGES = (HEAD_IMAGE_NAME, SIDECAR_IMAGE_NAME, DAEMON_IMAGE_NAME)


@dataclass
class Report:
    """What ``check_documents`` found: problems (the file is refused) and notes (it is not)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------- schemas


def strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused wherever it lists the fields of an object (and
    does not say ``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def jobset_schema() -> dict:
    """The JobSet CRD's ``v1alpha2`` openAPIV3Schema, as shipped in this package."""
    data = resources.files("mtc.head.tools.k8s").joinpath("schemas", SCHEMA_FILE).read_bytes()
    return json.loads(gzip.decompress(data))


@functools.lru_cache(maxsize=1)
def jobset_validator():
    """A strict jsonschema validator of JobSet documents (needs ``pip install 'mtc[k8s]'``)."""
    import jsonschema

    return jsonschema.Draft7Validator(strict(jobset_schema()))


@functools.lru_cache(maxsize=1)
def podmonitoring_validator():
    """A strict jsonschema validator of PodMonitoring (``monitoring.googleapis.com/v1``) documents: the
    fields of the CRD that mtc renders or a user is likely to add, with their types."""
    import jsonschema

    data = resources.files("mtc.head.tools.k8s").joinpath("schemas", PODMONITORING_SCHEMA_FILE).read_bytes()
    return jsonschema.Draft7Validator(strict(json.loads(gzip.decompress(data))))


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top)"


class _NoSchema(Exception):
    """kubernetes-validate has no schema for a custom resource's kind (not a core kind)."""


def _kubernetes_problem(doc: dict, version: str) -> str | None:
    """kubernetes-validate's first complaint about ``doc``, or None; _NoSchema for a kind of
    an API group with a domain (a custom resource), which it does not know."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{_path(e.path)}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        if "." in str(doc.get("apiVersion", "")).split("/")[0] and "/" in str(doc.get("apiVersion", "")):
            raise _NoSchema(e.message) from None
        return e.message
    return None


# ---------------------------------------------------------------------- typed pods


def _quantities_as_strings(pod: dict) -> dict:
    """``pod`` with numeric quantities (``cpu: 8``, ``google.com/tpu: 4``, ``sizeLimit: 1024``)
    as strings: Kubernetes accepts both, the client's typed models only strings."""
    pod = copy.deepcopy(pod)
    for key in ("containers", "initContainers", "ephemeralContainers"):
        for c in pod.get(key) or []:
            res = c.get("resources") if isinstance(c, dict) else None
            for part in ("limits", "requests"):
                if isinstance(res, dict) and isinstance(res.get(part), dict):
                    res[part] = {k: str(v) if isinstance(v, (int, float)) else v for k, v in res[part].items()}
    for v in pod.get("volumes") or []:
        ed = v.get("emptyDir") if isinstance(v, dict) else None
        if isinstance(ed, dict) and isinstance(ed.get("sizeLimit"), (int, float)):
            ed["sizeLimit"] = str(ed["sizeLimit"])
    return pod


def _typed_pod(spec: dict):
    """The pod spec as a ``kubernetes.client.V1PodSpec``; ValueError when it cannot be read."""
    from kubernetes.client import V1PodSpec
    from pydantic import ValidationError

    try:
        return V1PodSpec.from_dict(_quantities_as_strings(spec))
    except (ValidationError, TypeError, AttributeError) as e:
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _words(container) -> list[str]:
    """The container's command and args as words (a ``bash -c '...'`` string split as a shell would)."""
    out: list[str] = []
    for w in list(container.command or []) + list(container.args or []):
        try:
            out += shlex.split(w)
        except ValueError:
            out.append(w)
    return out


def _flags(container) -> dict[str, str]:
    """``key=value`` words of the container's command (the last one wins, as in MaxText)."""
    flags = {}
    for w in _words(container):
        key, sep, value = w.partition("=")
        if sep and key.isidentifier():
            flags[key] = value
    return flags


def _repository(image: str) -> str:
    return image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


# ---------------------------------------------------------------------- the check


@dataclass
class _Pod:
    job: str  # replicatedJob name
    pods: int | None  # pods per job (hosts per slice for the workers)
    spec: Any  # V1PodSpec


def check_documents(docs: list, *, params: float | None = None, peer_token_secret: str = "",
                    kubernetes_version: str = K8S_VERSION) -> Report:
    """Every problem of the JobSet (and its Secret) in ``docs`` (parsed YAML documents)."""
    r = Report()
    jobsets, secrets, monitorings = [], {}, []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict) or not doc.get("kind") or not doc.get("apiVersion"):
            r.problems.append(f"document {i + 1}: not a Kubernetes object (no kind/apiVersion)")
            continue
        name = f"{doc['kind']} {(doc.get('metadata') or {}).get('name', '?')}"
        if doc["kind"] == "JobSet":
            if doc["apiVersion"] != JOBSET_API:
                r.problems.append(f"{name}: apiVersion {doc['apiVersion']}; mtc's JobSets are {JOBSET_API}")
                continue
            errors = sorted(jobset_validator().iter_errors(doc), key=lambda e: list(map(str, e.path)))
            r.problems += [f"{name}: {_path(e.path)}: {e.message} (JobSet CRD schema)" for e in errors]
            jobsets.append(doc)
            continue
        if doc["kind"] == "PodMonitoring" and doc["apiVersion"] == "monitoring.googleapis.com/v1":
            errors = sorted(podmonitoring_validator().iter_errors(doc), key=lambda e: list(map(str, e.path)))
            r.problems += [f"{name}: {_path(e.path)}: {e.message} (PodMonitoring schema)" for e in errors]
            if not errors:
                monitorings.append(doc)
            continue
        try:
            problem = _kubernetes_problem(doc, kubernetes_version)
        except _NoSchema:
            r.notes.append(f"{name}: {doc['apiVersion']} is a custom resource without a schema here; not checked")
            continue
        if problem:
            r.problems.append(f"{name}: {problem} (kubernetes-validate {kubernetes_version})")
        if doc["kind"] == "Secret" and doc["apiVersion"] == "v1":
            from kubernetes.client import V1Secret

            try:
                secrets[(doc.get("metadata") or {}).get("name")] = V1Secret.from_dict(doc)
            except Exception as e:  # noqa: BLE001  pydantic's error, already reported by the schema check
                r.problems.append(f"{name}: cannot be read: {str(e).splitlines()[0]}")
    if not jobsets:
        r.problems.append(f"no JobSet ({JOBSET_API}) in the file; mtc manifests render writes one")
        return r
    seen = [_check_jobset(js, secrets, r, params=params, peer_token_secret=peer_token_secret,
                          version=kubernetes_version) for js in jobsets]
    for pm in monitorings:
        _check_pod_monitoring(pm, [s for s in seen if s is not None], r)
    return r


@dataclass
class _Seen:
    """What a PodMonitoring is checked against: a JobSet's pods and its head container."""

    name: str  # the JobSet's metadata.name
    namespace: str | None
    pods: list[_Pod]
    head_pod: _Pod
    head: Any  # V1Container


def _check_jobset(js: dict, secrets: dict, r: Report, *, params, peer_token_secret, version) -> _Seen | None:
    name = f"JobSet {(js.get('metadata') or {}).get('name', '?')}"
    namespace = (js.get("metadata") or {}).get("namespace")
    pods: list[_Pod] = []
    for rj in (js.get("spec") or {}).get("replicatedJobs") or []:
        if not isinstance(rj, dict):
            continue
        job_spec = ((rj.get("template") or {}).get("spec")) or {}
        pod_spec = ((job_spec.get("template") or {}).get("spec")) or {}
        where = f"{name}, replicatedJob {rj.get('name', '?')}"
        for kind, api, spec in (("Job", "batch/v1", job_spec), ("Pod", "v1", pod_spec)):
            problem = _kubernetes_problem({"apiVersion": api, "kind": kind, "metadata": {"name": "x"},
                                           "spec": spec}, version)
            if problem:
                r.problems.append(f"{where}: the {kind.lower()} template: {problem} (kubernetes-validate {version})")
        try:
            typed = _typed_pod(pod_spec)
        except ValueError as e:
            r.problems.append(f"{where}: the pod template cannot be read: {e}")
            continue
        pods.append(_Pod(str(rj.get("name", "?")), job_spec.get("parallelism"), typed))

    heads = [(p, c) for p in pods for c in (p.spec.init_containers or []) + (p.spec.containers or [])
             if {"local_checkpoint_directory", "enable_multi_tier_checkpointing"} & set(_flags(c))]
    if not heads:
        r.problems.append(f"{name}: no container runs MaxText with enable_multi_tier_checkpointing=true and "
                          "local_checkpoint_directory=...: the head's training command must set them "
                          "(mtc manifests render appends them)")
        return None
    head_pod, head = heads[0]
    flags = _flags(head)
    where_head = f"{name}, replicatedJob {head_pod.job}, container {head.name}"
    _check_command(where_head, head, flags, r)
    if flags.get("enable_multi_tier_checkpointing", "").lower() not in ("true", "1"):
        r.problems.append(f"{where_head}: enable_multi_tier_checkpointing is "
                          f"{flags.get('enable_multi_tier_checkpointing', 'not set')}; set it to true, or MaxText "
                          "does not checkpoint with mtc")
    lcd = flags.get("local_checkpoint_directory", "")
    if not lcd or not posixpath.isabs(lcd):
        r.problems.append(f"{where_head}: local_checkpoint_directory is {lcd or 'not set'}; give the absolute path "
                          "the ramdisk is mounted at, e.g. local_checkpoint_directory=/local")
        lcd = ""
    sidecars = [(p, c) for p in pods if p is not head_pod
                for c in (p.spec.init_containers or []) + (p.spec.containers or [])
                if c.name == SIDECAR_CONTAINER or _repository(c.image or "") in _MTC_IMAGES]
    if not sidecars:
        r.problems.append(f"{name}: no worker pod has the colocated Python sidecar (a container named "
                          f"{SIDECAR_CONTAINER} running the {SIDECAR_IMAGE_NAME} image), where the ramdisk "
                          "and the checkpoints live")
        return None
    for pod, c in sidecars:
        where = f"{name}, replicatedJob {pod.job}, container {c.name}"
        if lcd:
            _check_ramdisk(where, pod, c, lcd, params, r)
        _check_images(where, head.image or "", c.image or "", r)
        _check_token(where, c, namespace, secrets, peer_token_secret, r)
    _check_grace(name, pods, where_head, head, r)
    _check_ports(name, pods, where_head, head, r)
    _check_tls(name, [(head_pod, head), *sidecars], r)
    return _Seen(str((js.get("metadata") or {}).get("name", "?")), namespace, pods, head_pod, head)


def _check_command(where: str, head, flags: dict[str, str], r: Report) -> None:
    """A head command that cannot run as written: a placeholder left in it, a flag MaxText requires
    missing, or one given twice with different values (MaxText takes the last: which was meant?)."""
    words = _words(head)
    left_out = placeholders(words)
    if left_out:
        r.problems.append(f"{where}: the command holds {', '.join(repr(w) for w in left_out)}, which stands for "
                          "something left out; the container runs it as written: write the whole training command")
    for key in ("run_name", "base_output_directory"):
        if not flags.get(key):
            r.problems.append(f"{where}: the command sets no {key}=...; MaxText needs it (mtc keeps the backups and "
                              f"the job's key under base_output_directory/run_name): add {key}=VALUE")
    seen: dict[str, str] = {}
    for w in words:
        key, sep, value = w.partition("=")
        if sep and key.isidentifier():
            if key in seen and seen[key] != value:
                r.problems.append(f"{where}: the command sets {key} twice ({seen[key]} and {value}); MaxText takes "
                                  "the last: keep one")
            seen[key] = value


def _env(c) -> dict[str, str | None]:
    """The container's environment variables with a literal value (None for one read from elsewhere)."""
    return {e.name: e.value for e in c.env or []}


def _containers(pod: _Pod) -> list:
    return list(pod.spec.init_containers or []) + list(pod.spec.containers or [])


def _check_grace(name: str, pods: list[_Pod], where_head: str, head, r: Report) -> None:
    """Every pod's terminationGracePeriodSeconds above the head's MTC_PREEMPTION_GRACE_S, as render sets it:
    Kubernetes kills a pod that outlives its grace period, and the head (and the sidecars it reads) must
    live until the step reached is saved."""
    import math

    from mtc.head.preemption import grace_from_env

    text = _env(head).get("MTC_PREEMPTION_GRACE_S")
    try:
        grace = grace_from_env({"MTC_PREEMPTION_GRACE_S": text or ""})
    except ConfigError as e:
        r.problems.append(f"{where_head}: {e}")
        grace = None
    for p in pods:
        t = p.spec.termination_grace_period_seconds
        if t is None:
            t = 30  # Kubernetes' default
        fix = f"set it to {math.ceil(grace) + 10} (the grace + 10 s, as mtc manifests render does)" if grace else ""
        if t < 0:
            r.problems.append(f"{name}, replicatedJob {p.job}: terminationGracePeriodSeconds {t} is negative; "
                              f"give the seconds Kubernetes waits from a SIGTERM to a kill{', ' + fix if fix else ''}")
        elif grace is not None and t <= grace:
            r.problems.append(f"{name}, replicatedJob {p.job}: terminationGracePeriodSeconds {t} is not above "
                              f"MTC_PREEMPTION_GRACE_S={grace:g} (the head's time from a SIGTERM to its exit, to save "
                              f"the step reached): Kubernetes kills the pod before that save ends; {fix}, or lower "
                              "MTC_PREEMPTION_GRACE_S")


def _check_ports(name: str, pods: list[_Pod], where_head: str, head, r: Report) -> None:
    """Every container port in range; the head's MTC_METRICS_PORT a port it declares, clear of the others."""
    for p in pods:
        for c in _containers(p):
            for port in c.ports or []:
                for what, n in (("containerPort", port.container_port), ("hostPort", port.host_port)):
                    if n is not None and not 1 <= n <= 65535:
                        r.problems.append(f"{name}, replicatedJob {p.job}, container {c.name}: {what} {n} is out of "
                                          "range; ports are 1..65535")
    env = _env(head)
    text = env.get("MTC_METRICS_PORT")
    if not text:
        return
    try:
        port = int(text)
    except ValueError:
        port = -1
    peer = env.get("MTC_PEER_PORT") or ""
    taken = RESERVED_PORTS.get(port) or ("peer service" if peer.isdigit() and int(peer) == port else "")
    if not 0 <= port <= 65535 or taken:
        r.problems.append(f"{where_head}: MTC_METRICS_PORT={text} " + (f"is the {taken}'s port on the same host "
                          "network" if taken else "is not a port") + "; pick another in 1..65535, e.g. 9431")
        return
    named = {pt.name: pt.container_port for pt in head.ports or [] if pt.name}
    if port and "metrics" in named and named["metrics"] != port:
        r.problems.append(f"{where_head}: MTC_METRICS_PORT={port}, but its port named metrics is {named['metrics']}: "
                          f"the head serves /metrics on {port} and the PodMonitoring scrapes {named['metrics']}; make "
                          "them the same")


def _check_tls(name: str, containers: list, r: Report) -> None:
    """TLS as render sets it: MTC_TLS_DIR in the head and every sidecar or in none, each naming where a
    Secret volume is mounted, the same Secret everywhere (each process accepts only its CA's certificates)."""
    from mtc.shared.tls import ENV_TLS_DIR

    secrets: dict[str, str | None] = {}  # "replicatedJob J, container C" -> its TLS Secret (None: no TLS)
    for pod, c in containers:
        where = f"replicatedJob {pod.job}, container {c.name}"
        d = _env(c).get(ENV_TLS_DIR)
        if not d:
            secrets[where] = None
            continue
        mount = next((m for m in c.volume_mounts or [] if posixpath.normpath(m.mount_path) == posixpath.normpath(d)),
                     None)
        volume = next((v for v in pod.spec.volumes or [] if mount and v.name == mount.name), None)
        if mount is None or volume is None:
            r.problems.append(f"{name}, {where}: {ENV_TLS_DIR}={d}, but nothing is mounted there"
                              + (f" (volume {mount.name} is not in the pod)" if mount else "")
                              + ": mount the job's TLS Secret (ca.crt, tls.crt, tls.key from mtc tls generate) at "
                              f"{d}, or remove {ENV_TLS_DIR} from both the head and the sidecars (no TLS)")
            continue
        secrets[where] = volume.secret.secret_name if volume.secret else f"volume {volume.name}"
    if len(set(secrets.values())) <= 1:
        return
    head_where, head_secret = next(iter(secrets.items()))
    for where, secret in list(secrets.items())[1:]:
        if secret == head_secret:
            continue
        if head_secret is None or secret is None:
            on, off = (where, head_where) if head_secret is None else (head_where, where)
            r.problems.append(f"{name}: {on} has TLS ({ENV_TLS_DIR}) and {off} has not: they cannot talk; set "
                              f"{ENV_TLS_DIR} with the same Secret in both (mtc manifests render does), or in neither")
        else:
            r.problems.append(f"{name}: {head_where} reads its TLS files from {head_secret}, {where} from {secret}: "
                              "each accepts only certificates its own CA signed, so they cannot talk; mount the same "
                              "Secret in both")


def _check_pod_monitoring(pm: dict, seen: list[_Seen], r: Report) -> None:
    """A PodMonitoring scrapes the head's metrics port: its JobSet, the head's replicated job, a port it has."""
    name = f"PodMonitoring {(pm.get('metadata') or {}).get('name', '?')}"
    labels = ((pm.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    js_name = labels.get("jobset.sigs.k8s.io/jobset-name")
    job = labels.get("jobset.sigs.k8s.io/replicatedjob-name")
    target = next((s for s in seen if s.name == js_name), None) if js_name else (seen[0] if len(seen) == 1 else None)
    if target is None:
        r.problems.append(f"{name}: selects JobSet {js_name or '(any)'}, "
                          f"{'which is not in the file' if js_name else 'not one of the file'} (it holds "
                          f"{', '.join(s.name for s in seen) or 'none'}); set matchLabels "
                          "jobset.sigs.k8s.io/jobset-name to the JobSet's name")
        return
    ns = (pm.get("metadata") or {}).get("namespace")
    if ns != target.namespace:
        r.problems.append(f"{name}: in namespace {ns or '(default)'}, the JobSet {target.name} in "
                          f"{target.namespace or '(default)'}; a PodMonitoring only selects pods of its own namespace")
    metrics = _env(target.head).get("MTC_METRICS_PORT")
    head_job = target.head_pod.job
    if job is not None and job != head_job:
        r.problems.append(f"{name}: selects replicatedJob {job}; the head's /metrics is served in replicatedJob "
                          f"{head_job} (container {target.head.name}): set matchLabels "
                          f"jobset.sigs.k8s.io/replicatedjob-name: {head_job}")
        return
    if not metrics or metrics == "0":
        r.problems.append(f"{name}: the head (replicatedJob {head_job}, container {target.head.name}) serves no "
                          "metrics (no MTC_METRICS_PORT): set it and a port named metrics (mtc manifests render "
                          "--metrics-port 9431 writes both), or remove the PodMonitoring")
        return
    ports = {pt.name: pt.container_port for c in _containers(target.head_pod) for pt in c.ports or [] if pt.name}
    for ep in (pm.get("spec") or {}).get("endpoints") or []:
        port = ep.get("port")
        number = ports.get(port) if isinstance(port, str) else port
        if isinstance(port, str) and number is None:
            r.problems.append(f"{name}: endpoint port {port!r} is not the name of a port of the head's pod (it names "
                              f"{', '.join(sorted(ports)) or 'none'}); use the port named metrics")
        elif port != "metrics" and str(number) != str(metrics).strip():  # "metrics": checked with the JobSet
            r.problems.append(f"{name}: endpoint port {port} is {number}, where the head serves no metrics "
                              f"(MTC_METRICS_PORT={metrics}); scrape the port named metrics")


def _check_ramdisk(where: str, pod: _Pod, c, lcd: str, params: float | None, r: Report) -> None:
    mounts = {posixpath.normpath(m.mount_path): m.name for m in c.volume_mounts or []}
    volumes = {v.name: v for v in pod.spec.volumes or []}

    def is_ramdisk(v) -> bool:
        return bool((v.csi and v.csi.driver == CSI_DRIVER) or (v.empty_dir and v.empty_dir.medium == "Memory"))

    volume_name = mounts.get(posixpath.normpath(lcd))
    if volume_name is None:
        elsewhere = [f"{n} at {p}" for p, n in mounts.items() if n in volumes and is_ramdisk(volumes[n])]
        r.problems.append(f"{where}: nothing is mounted at local_checkpoint_directory={lcd}"
                          + (f" (the ramdisk volume {', '.join(elsewhere)})" if elsewhere else "")
                          + f": mount the ramdisk at {lcd}"
                          + (f", or set local_checkpoint_directory={elsewhere[0].split(' at ')[1]} in the head's "
                             "command" if elsewhere else ""))
        return
    v = volumes.get(volume_name)
    if v is None:
        r.problems.append(f"{where}: mounts volume {volume_name} at {lcd}, but the pod has no volume of that name")
        return
    if not is_ramdisk(v):
        r.problems.append(f"{where}: volume {volume_name} at {lcd} is not a ramdisk; use the CSI driver "
                          f"{CSI_DRIVER} or emptyDir: {{medium: Memory, sizeLimit: ...}}")
        return
    if v.csi:
        r.notes.append(f"{where}: the ramdisk is the {CSI_DRIVER} volume; its size is the cluster's "
                       "CheckpointConfiguration (inMemoryVolumeSize), not checked here")
        return
    hosts = pod.pods if isinstance(pod.pods, int) and pod.pods > 0 else 1
    need = ramdisk_size(params, hosts) if params is not None else None
    shown = f"{params:.6g}".replace("e+", "e") if params is not None else ""  # 8e09, as --params takes it
    fix = (f"mtc size --params {shown} --hosts {hosts} gives sizeLimit: {need.size_limit}"
           if need else f"mtc size --params P --hosts {hosts} gives it")
    if v.empty_dir.size_limit is None:
        r.problems.append(f"{where}: the memory emptyDir {volume_name} has no sizeLimit, so the ramdisk can grow "
                          f"until the node runs out of memory; {fix}")
        return
    try:
        have = parse_quantity(str(v.empty_dir.size_limit))
    except ConfigError:
        r.problems.append(f"{where}: sizeLimit {v.empty_dir.size_limit!r} of {volume_name} is not a Kubernetes "
                          "quantity (e.g. 57Gi)")
        return
    if need is None:
        r.notes.append(f"{where}: sizeLimit {v.empty_dir.size_limit} not checked against mtc size: give --params "
                       "(the model's parameters)")
    elif have < need.required_bytes:
        r.problems.append(f"{where}: sizeLimit {v.empty_dir.size_limit} ({format_bytes(have)}) of {volume_name} is "
                          f"less than the {format_bytes(need.required_bytes)} each of the {hosts} hosts per slice "
                          f"needs for {shown} parameters; {fix}")


def _check_images(where: str, head: str, sidecar: str, r: Report) -> None:
    if _repository(sidecar) == DAEMON_IMAGE_NAME:
        r.problems.append(f"{where}: image {sidecar} is the cluster-mode daemon, which does not run the Pathways "
                          f"colocated Python server; use {SIDECAR_IMAGE_NAME} with the head's tag")
    if image_versions(head) is None or image_versions(sidecar) is None:
        try:
            image_mismatches(head, sidecar)
        except ConfigError as e:
            r.problems.append(f"{where}: {e}")
        return
    for what, h, s in image_mismatches(head, sidecar):
        r.problems.append(f"{where}: image {sidecar} has {what} {s}, the head's {head} has {what} {h}; head and "
                          "sidecar must run exactly the same mtc, python and jax: use images built together "
                          "(python images/build.py build), with the same tag (mtc images check HEAD SIDECAR)")


def _check_token(where: str, c, namespace, secrets: dict, named: str, r: Report) -> None:
    env = {e.name: e for e in c.env or []}
    e = env.get(ENV_TOKEN)
    if e is None:
        r.problems.append(f"{where}: no {ENV_TOKEN} in its environment: the sidecars authenticate each other with "
                          f"it; add env {ENV_TOKEN} from a Secret (valueFrom.secretKeyRef)")
        return
    ref = e.value_from.secret_key_ref if e.value_from else None
    if ref is None:
        r.problems.append(f"{where}: {ENV_TOKEN} is not read from a Secret"
                          + (" (its value is written in the JobSet, for anyone who can read it)" if e.value else "")
                          + "; use valueFrom.secretKeyRef with a Secret holding the token")
        return
    secret = secrets.get(ref.name)
    if secret is None:
        if ref.name != named:
            r.problems.append(f"{where}: {ENV_TOKEN} comes from Secret {ref.name} (key {ref.key}), which is not in "
                              f"the file; add it (mtc manifests render writes one), or, if it exists in the cluster, "
                              f"say so with --peer-token-secret {ref.name}")
        return
    ns = secret.metadata.namespace if secret.metadata else None
    if ns != namespace:
        r.problems.append(f"{where}: Secret {ref.name} is in namespace {ns or '(default)'}, the JobSet in "
                          f"{namespace or '(default)'}; a pod can only read a Secret of its own namespace")
    import base64

    values = dict(secret.string_data or {})
    for k, v in (secret.data or {}).items():
        try:
            values.setdefault(k, base64.b64decode(v, validate=True).decode())
        except ValueError:
            r.problems.append(f"Secret {ref.name}: data.{k} is not base64")
    if ref.key not in values:
        r.problems.append(f"{where}: Secret {ref.name} has no key {ref.key!r} (it has: "
                          f"{', '.join(sorted(values)) or 'none'}); the sidecar reads {ENV_TOKEN} from it")
    elif len(values[ref.key].strip()) < MIN_TOKEN_CHARS:
        r.problems.append(f"Secret {ref.name}: the token under {ref.key!r} has {len(values[ref.key].strip())} "
                          f"characters, fewer than {MIN_TOKEN_CHARS}; use e.g. python -c 'import secrets; "
                          "print(secrets.token_hex(32))'")


def check_text(text: str, **options) -> Report:
    """``check_documents`` of the YAML documents in ``text``; a YAML error is one problem."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError("checking manifests needs PyYAML, jsonschema, kubernetes-validate and kubernetes: "
                          "pip install 'mtc[k8s]'") from e
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return Report(problems=[f"not valid YAML{at}: {getattr(e, 'problem', None) or e}"])
    return check_documents(docs, **options)
