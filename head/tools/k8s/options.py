"""What ``mtc manifests render`` works from: the names, images and ports a JobSet uses, the TPU
machine types and their slice shapes, ``ManifestOptions`` (the render flags) and ``Plan`` (the
checked values the documents are built from)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from mtc.shared.errors import ConfigError

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PODMONITORING_API = "monitoring.googleapis.com/v1"  # GKE managed Prometheus scrapes what one selects
CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
PATHWAYS_REGISTRY = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways"
TOKEN_KEY = "token"
RAMDISK_VOLUME = "mtc-ramdisk"
# TLS in transit: the job's TLS Secret (ca.crt, tls.crt, tls.key; `mtc tls generate`) mounted
# here in the head and the sidecars, which find it through MTC_TLS_DIR.
TLS_VOLUME = "mtc-tls"
TLS_MOUNT = "/etc/mtc/tls"
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
RESERVED_PORTS = {PROXY_PORT: "Pathways proxy", RM_PORT: "Pathways resource manager",
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
    topologies: frozenset[str] | None  # None: the v5p rule (``accepts``)

    def accepts(self, topology: str) -> bool:
        """Whether ``topology`` (``AxB`` or ``AxBxC``) is a slice shape GKE gives this machine type."""
        if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)+", topology):
            return False
        if self.topologies is not None:
            return topology in self.topologies
        dims = [int(d) for d in topology.split("x")]
        if len(dims) != 3:
            return False
        if topology in _V5P_SMALL:
            return True
        return dims == sorted(dims) and all(d % 4 == 0 for d in dims) and math.prod(dims) <= _V5P_MAX_CHIPS


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
    metrics_port: int = 0  # the head's /metrics (MTC_METRICS_PORT) and a PodMonitoring to scrape it; 0: neither
    tls: bool = True  # mount the Secret <name>-mtc-tls and set MTC_TLS_DIR (--no-tls: clear text)


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
    tls_secret_name: str  # "" when TLS is off


def topology_chips(topology: str) -> int:
    """The TPU chips of a slice of shape ``topology`` (``2x2x4``: 16)."""
    return math.prod(int(d) for d in topology.split("x"))
