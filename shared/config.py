"""The one mtc configuration, with MaxText's flag names (README, "Tiers and modes").

`MTCConfig` is frozen and validated on construction, so a config that exists is a config
that makes sense. Three ways to build one:

- keyword arguments: ``MTCConfig(enable_multi_tier_checkpointing=True, ...)``;
- MaxText-style ``key=value`` strings: ``MTCConfig.from_flags(sys.argv[1:], ignore_unknown=True)``
  (mtc's own settings, which MaxText's parser would refuse, also from ``MTC_*`` variables);
- environment variables ``MTC_<UPPER_FLAG_NAME>``: ``MTCConfig.from_env()``.

Decisions worth knowing:

- A backup interval of 0 means "no backup", as in MaxText (the guide enables backup with a
  *non-zero* interval). It is stored as ``None``, so ``0`` and ``None`` compare equal.
- ``cluster_spec`` selects the mode: empty means colocated (Pathways sidecars), a path means
  cluster mode (sidecar daemons described by that JSON). Asking for both
  (``colocated_python_checkpointing=True`` with a ``cluster_spec``) is an error.
- ``peer_token`` is a secret: it is left out of ``repr()`` and ``to_dict()``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtc.shared.errors import ConfigError

ENV_PREFIX = "MTC_"
# The peer token: the variable every sidecar reads it from (a Kubernetes Secret in production), and
# the shortest one accepted (the sidecars refuse shorter ones; the manifest renderer refuses them
# before a job is submitted).
ENV_TOKEN = "MTC_PEER_TOKEN"
MIN_TOKEN_CHARS = 16

# What a save does when data-parallel replicas disagree (``twin_check``).
TWIN_CHECK_MODES = ("warn", "fail", "off")

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
# The words of on and off for every MTC_* variable (``env_flag``) and MaxText flag mtc reads.
TRUE_WORDS = _TRUE | {"on"}
FALSE_WORDS = _FALSE | {"off"}
_NONE = frozenset({"none", ""})

# Fields that name a path or URL: os.PathLike is accepted and stored as str, so that the
# config stays a plain value (picklable, JSON-able, identical on head and sidecars).
_PATH_FIELDS = frozenset({"local_checkpoint_directory", "base_output_directory", "cluster_spec", "tls_dir"})


@dataclass(frozen=True)
class MTCConfig:
    """Validated, immutable multi-tier checkpointing configuration.

    MaxText flags (same names and defaults as MaxText):

    - ``enable_checkpointing``: master switch; when false nothing is saved.
    - ``enable_multi_tier_checkpointing``: turn multi-tier checkpointing on; needs
      ``local_checkpoint_directory`` and ``local_checkpoint_period > 0``.
    - ``colocated_python_checkpointing``: run the checkpoint work in Pathways colocated
      Python sidecars (the colocated mode; incompatible with ``cluster_spec``).
    - ``local_checkpoint_directory``: ramdisk mount path on every worker host; mtc writes
      under its ``mtc/`` subfolder.
    - ``local_checkpoint_period``: save a local checkpoint every this many steps (0: never).
    - ``multi_tier_checkpointing_backup_interval_minutes`` /
      ``multi_tier_checkpointing_backup_interval_steps``: back up to object storage every N
      minutes or N steps (at most one of them; ``None`` or 0: no backup).
    - ``base_output_directory``, ``run_name``: the backup root is
      ``<base_output_directory>/<run_name>/mtc``.

    mtc's own:

    - ``local_max_to_keep``: committed steps kept on each ramdisk (>= 1).
    - ``backup_max_to_keep``: backups kept in object storage (>= 1).
    - ``backup_scrub_interval_s``: every this many seconds, the hosts re-hash the blobs of the
      newest ``backup_scrub_backups`` backups in the background, repair a bad blob from a good
      ramdisk copy, and mark a backup they cannot repair damaged, so restore never takes it
      (default 3600; 0: no background scrub; ``mtc verify --backup`` runs one on demand).
    - ``backup_scrub_bytes_per_s``: the scrub's read bandwidth cap, per host (default 50 MiB/s).
    - ``backup_scrub_backups``: how many of the newest backups a scrub checks (default 2).
    - ``backup_scrub_ramdisk``: the scrub also hashes the hosts' ramdisk copies of those backups'
      blobs and removes corrupt ones (default false).
    - ``replication_factor``: copies of every blob across slices/hosts (>= 1; 1 = no peers).
    - ``peer_port``: TCP port of the peer service (0: pick a free port). In colocated mode the
      sidecar runs a peer service only when this is set (a single host has no peers).
    - ``peer_token``: shared secret peers must present; never shown in ``repr``.
    - ``cluster_spec``: path to a cluster spec JSON (cluster mode); empty: colocated mode.
    - ``tls_dir``: a folder with the job's ``ca.crt``, ``tls.crt`` and ``tls.key``: the control
      and peer connections run over mutual TLS (``MTC_TLS_DIR``; empty: clear text).
    - ``max_save_wait_s``: how long ``save`` waits for the previous save to finish before
      failing (``None``: wait as long as it takes).
    - ``prefetch_on_start``: creating the manager starts pulling, in the background, what the
      hosts lack of the newest restorable step (from peers, else the backup), so that
      ``restore`` finds it local (default true).
    - ``restore_host_wait_s``: how long a restore waits for hosts it needs that do not answer (a
      replaced host or slice still starting, after a failure or at the job's start) before it fails
      (``MTC_RESTORE_HOST_WAIT_S``; default 120; 0: fail at once). It plans again every few seconds,
      and says which hosts it waits for.
    - ``metrics_port``: serve Prometheus metrics at ``/metrics`` on this port of the head
      (``MTC_METRICS_PORT``; 0: no metrics).
    - ``metrics_address``: the address the head's ``/metrics`` binds (``MTC_METRICS_ADDRESS``;
      default ``0.0.0.0``, every interface: a Prometheus in the cluster scrapes the pod's IP, as the
      rendered manifests' PodMonitoring does; ``127.0.0.1``: this machine only).
    - ``twin_check``: what a save does when data-parallel replicas of one box of an array hold
      different bytes (silent data corruption on some host): ``warn`` (default: log it, report it
      in ``last_save_report.twin_mismatches``, do not commit that step; training goes on),
      ``fail`` (the save fails with an error naming the array, box and hosts; nothing is
      committed) or ``off``. Across hosts it compares the blob names the hosts return anyway.
    - ``twin_check_hash``: also hash the replicas no host writes (replicas on one host; in
      cluster mode, the copies the head does not send) while ``save`` blocks: one hash pass over
      them, where they are in the head's memory (CPU devices); default false.
    """

    enable_checkpointing: bool = True
    enable_multi_tier_checkpointing: bool = False
    colocated_python_checkpointing: bool = False
    local_checkpoint_directory: str = ""
    local_checkpoint_period: int = 0
    multi_tier_checkpointing_backup_interval_minutes: int | None = None
    multi_tier_checkpointing_backup_interval_steps: int | None = None
    base_output_directory: str = ""
    run_name: str = ""
    local_max_to_keep: int = 2
    backup_max_to_keep: int = 5
    backup_scrub_interval_s: int = 3600
    backup_scrub_bytes_per_s: int = 50 * 2**20
    backup_scrub_backups: int = 2
    backup_scrub_ramdisk: bool = False
    replication_factor: int = 2
    peer_port: int = 0
    peer_token: str = field(default="", repr=False)
    cluster_spec: str = ""
    tls_dir: str = ""
    max_save_wait_s: float | None = None
    restore_host_wait_s: float = 120.0
    prefetch_on_start: bool = True
    metrics_port: int = 0
    metrics_address: str = "0.0.0.0"
    twin_check: str = "warn"
    twin_check_hash: bool = False

    # ------------------------------------------------------------------ construction

    def __post_init__(self) -> None:
        self._check_types()
        # 0 means "unset" for the backup intervals (MaxText enables backup with a non-zero
        # value); storing None keeps one spelling of "no backup".
        for name in ("multi_tier_checkpointing_backup_interval_minutes",
                     "multi_tier_checkpointing_backup_interval_steps"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, None)
        object.__setattr__(self, "twin_check", self.twin_check.strip().lower())
        problems = self._problems()
        if problems:
            raise ConfigError("invalid mtc config:\n  - " + "\n  - ".join(problems))

    def _check_types(self) -> None:
        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _KINDS[f.name]
            if value is None and kind.optional:
                continue
            if f.name in _PATH_FIELDS and isinstance(value, os.PathLike):
                value = os.fspath(value)
            ok = _type_ok(kind.base, value)
            if ok:
                # Normalise numpy scalars and PathLikes to plain Python values.
                object.__setattr__(self, f.name, kind.base(value))
            else:
                shown = "<hidden>" if f.name == "peer_token" else repr(value)
                problems.append(
                    f"{f.name} must be {kind.describe()}, got {type(value).__name__} {shown}; "
                    "fix the value's type (MTCConfig.from_flags parses strings)")
        if problems:
            raise ConfigError("invalid mtc config:\n  - " + "\n  - ".join(problems))

    def _problems(self) -> list[str]:
        p: list[str] = []
        minutes = self.multi_tier_checkpointing_backup_interval_minutes
        steps = self.multi_tier_checkpointing_backup_interval_steps
        period = self.local_checkpoint_period

        if period < 0:
            p.append(f"local_checkpoint_period={period} is negative; use 0 to disable local "
                     "checkpoints or a positive number of steps")
        if self.enable_multi_tier_checkpointing:
            if not self.local_checkpoint_directory.strip():
                p.append("enable_multi_tier_checkpointing=True needs local_checkpoint_directory: "
                         "set it to the ramdisk mount path "
                         "(e.g. local_checkpoint_directory=/local)")
            if period <= 0:
                p.append("enable_multi_tier_checkpointing=True needs local_checkpoint_period > 0: "
                         "set it to how often to save locally, in steps "
                         "(e.g. local_checkpoint_period=10)")
        if minutes is not None and minutes < 0:
            p.append(f"multi_tier_checkpointing_backup_interval_minutes={minutes} is negative; "
                     "give a positive number of minutes, or None/0 for no backup")
        if steps is not None and steps < 0:
            p.append(f"multi_tier_checkpointing_backup_interval_steps={steps} is negative; "
                     "give a positive number of steps, or None/0 for no backup")
        if minutes is not None and steps is not None:
            p.append("multi_tier_checkpointing_backup_interval_minutes and "
                     "multi_tier_checkpointing_backup_interval_steps are both set; they are "
                     "exclusive: keep one and set the other to None")
        if steps is not None and steps > 0 and period > 0 and steps < period:
            p.append(f"multi_tier_checkpointing_backup_interval_steps={steps} is below "
                     f"local_checkpoint_period={period}; backups are copied from local "
                     f"checkpoints, so use at least {period} (ideally a multiple of it)")
        if (minutes is not None or steps is not None) and not self.base_output_directory.strip():
            p.append("a backup interval is set but base_output_directory is empty; set "
                     "base_output_directory (e.g. gs://bucket/path or a local directory) or "
                     "unset the backup interval")
        if self.local_max_to_keep < 1:
            p.append(f"local_max_to_keep={self.local_max_to_keep} must be >= 1 (the ramdisk "
                     "must hold at least the latest step)")
        if self.backup_max_to_keep < 1:
            p.append(f"backup_max_to_keep={self.backup_max_to_keep} must be >= 1")
        if self.backup_scrub_interval_s < 0:
            p.append(f"backup_scrub_interval_s={self.backup_scrub_interval_s} is negative; give seconds, or 0 "
                     "for no background scrub")
        if self.backup_scrub_bytes_per_s < 1 or self.backup_scrub_backups < 1:
            p.append(f"backup_scrub_bytes_per_s={self.backup_scrub_bytes_per_s} and backup_scrub_backups="
                     f"{self.backup_scrub_backups} must be >= 1 (turn the scrub off with backup_scrub_interval_s=0)")
        if self.replication_factor < 1:
            p.append(f"replication_factor={self.replication_factor} must be >= 1 "
                     "(1: no peer copies)")
        if not 0 <= self.peer_port <= 65535:
            p.append(f"peer_port={self.peer_port} is out of range; use 1..65535, or 0 to pick "
                     "a free port")
        if not (math.isfinite(self.restore_host_wait_s) and self.restore_host_wait_s >= 0):
            p.append(f"restore_host_wait_s={self.restore_host_wait_s} must be a finite number of seconds >= 0 "
                     "(0: a restore fails at once when a host it needs does not answer)")
        if not 0 <= self.metrics_port <= 65535:
            p.append(f"metrics_port={self.metrics_port} is out of range; use 1..65535, or 0 for no "
                     "metrics")
        if not self.metrics_address.strip() or self.metrics_address != self.metrics_address.strip():
            p.append(f"metrics_address={self.metrics_address!r} is not an address; use 0.0.0.0 (every "
                     "interface, the default), 127.0.0.1 (this machine only) or an address of this host")
        if self.colocated_python_checkpointing and self.cluster_spec:
            p.append("colocated_python_checkpointing=True and cluster_spec are both set; "
                     "they select different modes: clear cluster_spec for colocated Python, "
                     "or set colocated_python_checkpointing=False for cluster mode")
        if self.twin_check not in TWIN_CHECK_MODES:
            p.append(f"twin_check={self.twin_check!r} is not one of {', '.join(TWIN_CHECK_MODES)}; use warn "
                     "(log and skip a step whose replicas disagree), fail (the save fails) or off")
        w = self.max_save_wait_s
        if w is not None and (math.isnan(w) or math.isinf(w) or w < 0):
            p.append(f"max_save_wait_s={w} must be a finite number of seconds >= 0, or None "
                     "to wait for the previous save as long as it takes")
        return p

    @classmethod
    def from_flags(cls, flags: Iterable[str], *, ignore_unknown: bool = False,
                   environ: Mapping[str, str] | None = None, **overrides: Any) -> MTCConfig:
        """Build from MaxText-style ``key=value`` strings; keyword ``overrides`` win.

        Booleans accept true/false/1/0/yes/no (any case); optional numbers accept
        ``None`` or an empty value. An unknown key is an error that suggests the closest
        flag, unless ``ignore_unknown`` is true (for passing MaxText's whole command line,
        where items without ``=`` are skipped too). A key given twice is an error.

        mtc's own settings, which MaxText's parser would refuse as flags (``peer_port``,
        ``replication_factor``, ...), may come from ``MTC_<NAME>`` variables of ``environ``
        (default ``os.environ``; ``{}`` for none), as ``mtc manifests render`` sets them; a flag
        or an override wins over the environment. MaxText's own flags are never taken from it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in _MTC_OWN:
            var = ENV_PREFIX + name.upper()
            if var in env:
                values[name] = _parse(_KINDS[name], env[var], var)
        given: set[str] = set()
        for item in flags:
            key, sep, raw = str(item).partition("=")
            key = key.strip()
            if not sep:
                if ignore_unknown:
                    continue
                raise ConfigError(f"flag {item!r} is not of the form key=value "
                                  "(e.g. local_checkpoint_period=10)")
            if key not in _KINDS:
                if ignore_unknown:
                    _warn_if_misspelt(key)
                    continue
                raise ConfigError(_unknown_message(key, "flag"))
            if key in given:
                raise ConfigError(f"flag {key} is given more than once; keep one "
                                  f"(pass keyword overrides to replace a value)")
            given.add(key)
            values[key] = _parse(_KINDS[key], raw, key)
        _check_known(overrides)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> MTCConfig:
        """Build from ``MTC_<UPPER_FLAG_NAME>`` environment variables; ``overrides`` win.

        e.g. ``MTC_LOCAL_CHECKPOINT_PERIOD=10``, ``MTC_CLUSTER_SPEC=/run/spec.json``,
        ``MTC_PEER_TOKEN=...``. A value that does not parse raises, naming the variable.
        Other ``MTC_*`` variables belong to other parts of mtc and are ignored, except that
        one that looks like a misspelt flag variable gets a warning.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, kind in _KINDS.items():
            var = ENV_PREFIX + name.upper()
            if var in env:
                values[name] = _parse(kind, env[var], var)
        for message in misspelled_env(env):
            warnings.warn(message, stacklevel=2)
        _check_known(overrides)
        values.update(overrides)
        return cls(**values)

    def with_cluster_spec_from_env(self, environ: Mapping[str, str] | None = None) -> MTCConfig:
        """This config with ``MTC_CLUSTER_SPEC``'s path where it names no cluster spec: the variable
        switches a training script to cluster mode without touching it, the one field the
        environment fills in for a config built in code."""
        spec = (os.environ if environ is None else environ).get(ENV_PREFIX + "CLUSTER_SPEC", "").strip()
        return self.replace(cluster_spec=spec) if spec and not self.cluster_spec else self

    def replace(self, **changes: Any) -> MTCConfig:
        """A validated copy with ``changes`` applied."""
        _check_known(changes)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived values

    @property
    def mode(self) -> str:
        """``"cluster"`` when a cluster spec is given, else ``"colocated"``."""
        return "cluster" if self.cluster_spec else "colocated"

    @property
    def ramdisk_root(self) -> Path:
        """Where mtc keeps its files on each host: ``<local_checkpoint_directory>/mtc``.

        mtc uses its own subfolder because the ramdisk may be shared with other tools.
        """
        if not self.local_checkpoint_directory.strip():
            # Path("") / "mtc" would silently be relative to the current directory.
            raise ConfigError("local_checkpoint_directory is empty, so there is no ramdisk "
                              "root; set local_checkpoint_directory to the ramdisk mount path")
        return Path(self.local_checkpoint_directory) / "mtc"

    @property
    def backup_root(self) -> str:
        """``<base_output_directory>/<run_name>/mtc`` (``<base>/mtc`` with no run name).

        Joined as a string, not a Path, so that ``gs://`` URLs keep their double slash.
        """
        base = self.base_output_directory.strip()
        if not base:
            raise ConfigError("base_output_directory is empty, so there is no backup root; "
                              "set base_output_directory (e.g. gs://bucket/path)")
        run = self.run_name.strip("/")
        # A base of "/" strips to "", which still yields an absolute "/<run>/mtc".
        return f"{base.rstrip('/')}/{run}/mtc" if run else f"{base.rstrip('/')}/mtc"

    @property
    def backup_enabled(self) -> bool:
        """True when a backup interval (minutes or steps) is set."""
        return (self.multi_tier_checkpointing_backup_interval_minutes is not None
                or self.multi_tier_checkpointing_backup_interval_steps is not None)

    def should_save(self, step: int) -> bool:
        """True when ``step`` is a local checkpoint step (``step % local_checkpoint_period == 0``).

        Always false when checkpointing is off (``enable_checkpointing=False``) or the period
        is 0.
        """
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        period = self.local_checkpoint_period
        return self.enable_checkpointing and period > 0 and step % period == 0

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain dict, without ``peer_token`` (a secret)."""
        d = dataclasses.asdict(self)
        del d["peer_token"]
        return d


# ---------------------------------------------------------------------- field kinds


@dataclass(frozen=True)
class _Kind:
    base: type
    optional: bool

    def describe(self) -> str:
        word = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}[self.base]
        return word + (" or None" if self.optional else "")


def _kind_of(annotation: str) -> _Kind:
    # Annotations are strings (from __future__ import annotations); the set is small and fixed.
    table = {
        "bool": _Kind(bool, False),
        "int": _Kind(int, False),
        "str": _Kind(str, False),
        "float": _Kind(float, False),
        "int | None": _Kind(int, True),
        "float | None": _Kind(float, True),
    }
    return table[annotation]


_KINDS: dict[str, _Kind] = {f.name: _kind_of(f.type) for f in dataclasses.fields(MTCConfig)}
# mtc's own settings: not MaxText flags, so a MaxText command line cannot carry them.
_MTC_OWN = ("local_max_to_keep", "backup_max_to_keep", "backup_scrub_interval_s", "backup_scrub_bytes_per_s",
            "backup_scrub_backups", "backup_scrub_ramdisk", "replication_factor", "peer_port", "peer_token",
            "cluster_spec", "tls_dir", "max_save_wait_s", "restore_host_wait_s", "prefetch_on_start", "metrics_port",
            "metrics_address", "twin_check", "twin_check_hash")


def _type_ok(base: type, value: Any) -> bool:
    # bool is an int subclass: refuse it where a number is meant, and numbers where a bool is.
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if base is int:
        return isinstance(value, numbers.Integral)
    if base is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, base)


def _parse(kind: _Kind, raw: str, label: str) -> Any:
    """Parse one string value; errors name ``label`` (the flag or environment variable)."""
    text = raw.strip()
    if kind.optional and text.lower() in _NONE:
        return None
    try:
        if kind.base is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if kind.base is int:
            return int(text, 10)
        if kind.base is float:
            return float(text)
    except ValueError:
        hint = {bool: "true or false", int: "an integer", float: "a number"}[kind.base]
        if kind.optional:
            hint += " or None"
        raise ConfigError(f"{label}={raw!r} is not {hint}; e.g. {label}={_example(kind)}") from None
    return raw  # strings are taken as given: paths may legitimately contain spaces


def _example(kind: _Kind) -> str:
    return {bool: "true", int: "10", float: "30"}[kind.base]


def _unknown_message(key: str, what: str) -> str:
    close = difflib.get_close_matches(key, list(_KINDS), n=1, cutoff=0.6)
    if close:
        return f"unknown {what} {key!r}; did you mean {close[0]!r}?"
    return f"unknown {what} {key!r}; valid names: {', '.join(_KINDS)}"


def _warn_if_misspelt(key: str) -> None:
    """With ignore_unknown, MaxText's other flags pass silently, but one that looks like an mtc or
    checkpointing flag is most likely a typo that would turn a feature off without a word."""
    # 0.9: a letter or two off an mtc flag, not MaxText's own checkpoint_period or async_checkpointing.
    close = difflib.get_close_matches(key, list(_KINDS), n=1, cutoff=0.9)
    looks = close or key.startswith(("multi_tier", "mtc_"))
    if looks:
        hint = f"; did you mean {close[0]!r}?" if close else ""
        warnings.warn(f"flag {key!r} is not an mtc flag and is ignored{hint}", stacklevel=3)


def _check_known(names: Iterable[str]) -> None:
    for name in names:
        if name not in _KINDS:
            raise ConfigError(_unknown_message(name, "config field"))


# --- every MTC_* variable mtc reads ---------------------------------------------------------------------
# MTCConfig's own are MTC_<FIELD> (``from_env``); these are read by one part of mtc, before a
# configuration exists (the supervisor, the MaxText launcher) or outside it: name -> (default, meaning).
PROCESS_ENV: dict[str, tuple[str, str]] = {
    "MTC_SUPERVISOR": ("1", "0: python -m mtc.head.maxtext runs the training process without its supervisor"),
    "MTC_STANDBY": ("1", "0: the supervisor keeps no warm standby (a restart is cold, in place)"),
    "MTC_RESTARTS": ("8", "the most restarts the supervisor makes within MTC_RESTART_WINDOW_S"),
    "MTC_RESTART_WINDOW_S": ("3600", "the window of MTC_RESTARTS, in seconds"),
    "MTC_SUPERVISOR_PROMOTION": ("", "set by the supervisor in a promoted process (its restart's record); not for users"),
    "MTC_PREEMPTION_GRACE_S": ("25", "seconds from a SIGTERM to the exit: the save, then the copies"),
    "MTC_SAVE_FAILURE_GRACE_S": ("300", "the launcher retries a save whose host was lost for this long"),
    "MTC_COMPILE_CACHE": ("1", "0: the launcher leaves JAX's compilation cache as MaxText sets it"),
    "MTC_COMPILE_CACHE_DIR": ("", "JAX's cache folder (default <temp dir>/mtc-compile-cache-<uid>)"),
    "MTC_EXPORT_ON_FINISH": ("", "1 (MaxText's checkpoint_dir) or a folder: a finished run exports its last step"),
    "MTC_DATA_RESTART": ("0", "1: a restore whose data position cannot be restored starts the data over, said"),
    "MTC_JOB_KEY": ("", "the job's key for sealing backups (default: derived from MTC_PEER_TOKEN)"),
    "MTC_JOB_KEYS_ACCEPTED": ("", "older job keys whose backups are still read (comma-separated)"),
    "MTC_UNSIGNED_BACKUPS": ("", "refuse: a backup root without seals is not read either"),
    "MTC_CRASH_AT": ("", "fault injection for tests: a sidecar exits at this crash point"),
    "MTC_FAIL_AT": ("", "fault injection for tests: a sidecar operation fails at this point"),
    "MTC_TEST_HEARTBEAT_S": ("60", "the test run names tests running longer than this (tests only)"),
}


def known_env() -> set[str]:
    """Every ``MTC_*`` variable mtc reads: MTCConfig's ``MTC_<FIELD>`` and ``PROCESS_ENV``."""
    return {ENV_PREFIX + n.upper() for n in _KINDS} | set(PROCESS_ENV)


def misspelled_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``MTC_*`` variable that is not one mtc reads but close to one (as MaxText warns
    about a misspelled flag): set, it would do nothing. Variables of other tools that share the prefix
    and resemble none are left alone."""
    env = os.environ if environ is None else environ
    known = known_env()
    out = []
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in known:
            close = difflib.get_close_matches(var, known, n=1, cutoff=0.85)
            if close:
                out.append(f"environment variable {var} is not one mtc reads; did you mean {close[0]}?")
    return out


def env_flag(name: str, environ: Mapping[str, str] | None = None, default: bool = False) -> bool:
    """The on/off variable ``name``, by the one rule every mtc variable follows: 1/true/yes/on or
    0/false/no/off (any case), unset or empty the default; anything else is a ConfigError naming it."""
    text = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if not text:
        return default
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={text!r} is neither on nor off; set it to 1 or 0 (true/false, yes/no, on/off)")


def env_number(name: str, environ: Mapping[str, str] | None = None, *, default: float, integer: bool = False,
               minimum: float = 0.0, inclusive: bool = False, why: str = "") -> float:
    """The number ``name`` (unset or empty: ``default``), finite and above ``minimum`` (or equal to it,
    ``inclusive``); a ConfigError naming the variable otherwise (``why``: what to do, said in the error)."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = None
    if value is None or not (value >= minimum if inclusive else value > minimum) or value == float("inf"):
        raise ConfigError(f"{name}={text!r} is not a number {'>=' if inclusive else '>'} {minimum:g}"
                          + (" (a whole one)" if integer else "") + (f"; {why}" if why else ""))
    return value
