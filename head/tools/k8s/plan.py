"""``plan(options)``: the checks of ``ManifestOptions`` and the values derived from them (slice
shape, the MaxText flags merged from the command and the render flags, the ramdisk's mount path
and size, the images, the Secret's name). Error messages name the render flag to change."""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

from mtc.shared.config import MIN_TOKEN_CHARS, MTCConfig
from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes, ramdisk_size

from mtc.head.tools.k8s.images import job_images
from mtc.head.tools.k8s.options import (DEFAULT_PEER_PORT, HEAD_JOB, MACHINES, RESERVED_PORTS, WORKER_JOB, Machine,
                                             ManifestOptions, Plan, topology_chips)


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
    if not 0 < o.preemption_grace_s <= 3600:  # not inf: the pods' grace period is a whole number of seconds above it
        raise ConfigError(f"--preemption-grace-s={o.preemption_grace_s:g} must be > 0 and at most 3600 (seconds from a "
                          "SIGTERM to the exit, for saving the step reached; a preemption notice gives about 30)")
    if not 1 <= o.peer_port <= 65535:
        raise ConfigError(f"--peer-port={o.peer_port} is out of range; use 1..65535 "
                          f"(default {DEFAULT_PEER_PORT})")
    if o.peer_port in RESERVED_PORTS:
        raise ConfigError(f"--peer-port={o.peer_port} is the {RESERVED_PORTS[o.peer_port]}'s port "
                          f"on the same host network; pick another, e.g. {DEFAULT_PEER_PORT}")
    if o.metrics_port and (not 1 <= o.metrics_port <= 65535 or o.metrics_port in RESERVED_PORTS
                           or o.metrics_port == o.peer_port):
        taken = RESERVED_PORTS.get(o.metrics_port) or ("peer service" if o.metrics_port == o.peer_port else "")
        raise ConfigError(f"--metrics-port={o.metrics_port} " + (f"is the {taken}'s port on the same host network"
                          if taken else "is out of range") + "; pick another in 1..65535, e.g. 9431 (0: no metrics)")
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
    head_image, sidecar_image = job_images(o)
    return Plan(options=o, machine=machine, hosts_per_slice=hosts, num_slices=slices, flags=flags,
                appended=appended, ramdisk_dir=ramdisk_dir, size_limit=size_limit,
                head_image=head_image, sidecar_image=sidecar_image,
                pathways_gcs_location=gcs.rstrip("/"),
                secret_name=o.peer_token_secret or f"{o.name}-mtc-peer-token",
                tls_secret_name=f"{o.name}-mtc-tls" if o.tls else "")


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


def _slice_shape(compute_type: str, topology: str) -> tuple[Machine, int]:
    machine = MACHINES.get(compute_type)
    if machine is None:
        raise ConfigError(f"--compute-type={compute_type!r} is not a TPU machine type mtc knows; use one of "
                          f"{', '.join(MACHINES)}")
    if not machine.accepts(topology):
        shapes = (", ".join(sorted(machine.topologies, key=topology_chips)) if machine.topologies is not None else
                  "2x2x1, 2x2x2, 2x2x4, 2x4x4, or AxBxC with A <= B <= C, each a multiple of 4")
        raise ConfigError(f"--topology={topology!r} is not a slice shape of {compute_type}; use one of {shapes}")
    hosts = max(1, topology_chips(topology) // machine.chips_per_host)
    return machine, hosts


def placeholders(words: list[str]) -> list[str]:
    """Words of a command that stand for something left out (``...``, ``<ARGS>``): copied from a
    usage line, they reach the container as they are, and it cannot run."""
    return [w for w in words if "..." in w or "\u2026" in w or re.fullmatch(r"<[^<>]+>", w)]


def _command_flags(command: str) -> dict[str, str]:
    """The ``key=value`` items of the training command (last one wins, as in MaxText)."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ConfigError(f"--command cannot be parsed as a shell command ({e}); check its quotes") from None
    left_out = placeholders(words)
    if left_out:
        raise ConfigError(f"--command holds {', '.join(repr(w) for w in left_out)}, which stands for something "
                          "left out: the pod would run it as written; give the whole training command, e.g. "
                          "--command 'python3 -m mtc.head.maxtext maxtext/configs/base.yml model_name=llama3.1-8b'")
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


def _merge_flags(o: ManifestOptions) -> tuple[dict[str, str], tuple[str, ...]]:
    """Every managed MaxText flag's value, and the ``key=value`` items the command lacks."""
    if not o.command.strip():
        raise ConfigError("--command is empty; give the training command, e.g. "
                          "--command 'python3 -m mtc.head.maxtext maxtext/configs/base.yml model_name=llama3.1-8b'")
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
