"""The ``mtc`` command line.

Subcommands:

- ``mtc size --params 70e9 --hosts 32 [--ramdisk DIR]``: ramdisk size per host, with the steps of
  the calculation and a Kubernetes ``sizeLimit``; with ``--ramdisk``, whether DIR fits and is fast.
- ``mtc demo``: a small training run with a crash and a restore (``mtc.head.tools.demo``).
- ``mtc restore-version show|set|clear``: list backups and pin the one to restore.
- ``mtc manifests render ...``: the JobSet of a Pathways job with mtc (``mtc.head.tools.manifests``).
- ``mtc manifests check FILE``: a hand-edited JobSet against the schemas and mtc's rules
  (``mtc.head.tools.manifest_check``).
- ``mtc images check HEAD SIDECAR [--engine podman]``: the two images' versions (tags, labels).

``python -m mtc.head.tools.cli ...`` works the same as ``mtc ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mtc.head.preemption import DEFAULT_GRACE_S
from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes, ramdisk_size

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Usage errors (bad options or values) return 2 rather than raising SystemExit, so the
    function can be called in-process.
    """
    parser = build_parser()
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `mtc` (subcommands size, demo, restore-version, manifests)."""
    from mtc.shared.version import MTC_VERSION, PROTOCOL_VERSION

    parser = argparse.ArgumentParser(prog="mtc", description="Multi-tier checkpointing tools.")
    parser.add_argument("--version", action="version", version=f"mtc {MTC_VERSION} (protocol {PROTOCOL_VERSION})")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    size = sub.add_parser(
        "size", help="ramdisk size per host",
        description="Ramdisk size per host: params x bytes-per-param / hosts x steps kept "
                    "x (1 + buffer), as in the MaxText multi-tier checkpointing guide.")
    size.add_argument("--params", type=_count, required=True,
                      help="model parameters, e.g. 70e9 or 70B (suffixes K, M, B, T)")
    size.add_argument("--hosts", type=int, required=True, help="hosts in the slice")
    size.add_argument("--buffer", type=float, default=0.15,
                      help="safety buffer as a fraction, 0..1 (default 0.15)")
    size.add_argument("--bytes-per-param", type=float, default=12,
                      help="checkpoint bytes per parameter, weights and optimizer state "
                           "(default 12)")
    size.add_argument("--steps-kept", type=int, default=2,
                      help="steps the ramdisk holds at once (default 2: one committed, "
                           "one being written)")
    size.add_argument("--peer-copies", type=int, default=0,
                      help="copies of other hosts' shards each host keeps (the peer tier): 0 when slices are "
                           "data-parallel twins (default), replication_factor - 1 with one slice")
    size.add_argument("--ramdisk", type=Path, metavar="DIR",
                      help="also check this ramdisk directory: its filesystem, page size and room "
                           "(exit status 1 when it is too small)")
    size.add_argument("--json", action="store_true", help="print JSON instead of text")
    size.set_defaults(func=_cmd_size)

    demo = sub.add_parser("demo", help="train on a local 2x2 cluster through every fault and recovery",
                          description="Train a small model on a local cluster of 2 slices x 2 hosts (sidecar "
                                      "daemons, ramdisk folders, a local backup directory) while killing a sidecar "
                                      "mid-save, replacing a host, losing and regaining a slice and losing every "
                                      "ramdisk; check the result bit for bit against an uninterrupted run.")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default 40; 20 with --quick)")
    demo.add_argument("--period", type=int, default=2, help="local checkpoint period in steps (default 2)")
    demo.add_argument("--quick", action="store_true", help="a shorter run (for CI)")
    # None here, a fresh directory in the handler: a default computed while building the
    # parser would create a temp dir on every `mtc` invocation.
    demo.add_argument("--workdir", type=Path, default=None,
                      help="working directory (default: a fresh directory in /dev/shm, else in the temp directory)")
    demo.add_argument("--keep", action="store_true", help="keep the ramdisk and backup folders afterwards")
    demo.add_argument("--timeline", type=Path, default=Path("demo-out") / "timeline.png",
                      help="where to write the timeline picture (default demo-out/timeline.png)")
    demo.set_defaults(func=_cmd_demo)

    pl = sub.add_parser(
        "plan", help="how often to checkpoint to each tier, and the goodput it buys",
        description="Recommend local_checkpoint_period and the backup interval from the model size, the "
                    "hosts, the mean time between failures and the cost of each tier (Young/Daly per tier), "
                    "and print the expected goodput against a backup-only setup and against blocking saves.")
    pl.add_argument("--params", type=_count, required=True, help="model parameters, e.g. 70e9 or 70B")
    pl.add_argument("--hosts", type=int, required=True, help="hosts per slice")
    pl.add_argument("--slices", type=int, default=1, help="slices (data-parallel: each holds the whole state)")
    pl.add_argument("--mtbf", required=True, help="mean time between failures of the job: 1h, 30m, 3600 (seconds)")
    pl.add_argument("--step-time", type=float, default=1.0, help="seconds per training step (default 1)")
    pl.add_argument("--bytes-per-param", type=float, default=12.0, help="checkpoint bytes per parameter (12)")
    pl.add_argument("--backup-fraction", type=float, default=0.05,
                    help="share of failures that lose every ramdisk copy and need the backup (default 0.05)")
    pl.add_argument("--peer-fraction", type=float, default=0.5,
                    help="share of the other failures that replace a host, restored from a peer (default 0.5)")
    pl.add_argument("--backup-overhead", type=float, default=0.05,
                    help="share of a background upload's duration charged to training (default 0.05)")
    src = pl.add_mutually_exclusive_group()
    src.add_argument("--measure", action="store_true", help="measure the rates with mtc on this machine")
    src.add_argument("--rates", help="GB/s per host: d2h,write,backup,ram_read,peer,backup_read")
    src.add_argument("--costs", help="seconds per host: blocked,write,backup,restore_ram,restore_peer,restore_backup")
    pl.set_defaults(func=_cmd_plan)

    im = sub.add_parser("images", help="check that a head and a sidecar image can run together")
    im_sub = im.add_subparsers(dest="images_action", metavar="ACTION")
    ic = im_sub.add_parser("check", help="compare the versions two image references carry",
                           description="Compare the mtc, Python and jax versions in the tags of a head and a "
                                       "sidecar image (<mtc>-python_X.Y-jax_X.Y.Z, as images/build.py tags them); "
                                       "a mismatch prints the table and exits 1. With --engine, the labels of the "
                                       "two images in that engine's local storage too; without it nothing is "
                                       "reached, and the labels are checked by the images themselves at build time "
                                       "and by the head at start-up.")
    ic.add_argument("head_image")
    ic.add_argument("sidecar_image")
    ic.add_argument("--engine", choices=("docker", "podman"), default=None,
                    help="also compare the images' labels (mtc.version, mtc.protocol, mtc.python, mtc.jax, "
                         "mtc.jaxlib), read from this engine's local images, with each other and with the tags")
    ic.set_defaults(func=_cmd_images_check)

    st = sub.add_parser(
        "status", help="which steps live where, and which one a restore would choose",
        description="For a running local cluster (--cluster-spec) or the ramdisk folders of a stopped job "
                    "(--local-checkpoint-directory, one per host), plus the backup root: a table of steps x tiers "
                    "(hosts, replication, backups), the restore.version pin, and which step a restore would "
                    "choose and why. Read-only: it never takes the hosts from a running head.")
    st.add_argument("--cluster-spec", help="the cluster spec of a running local cluster (MTC_CLUSTER_SPEC)")
    st.add_argument("--local-checkpoint-directory", nargs="+", metavar="DIR",
                    help="ramdisk folder(s) of a stopped job, one per host")
    st.add_argument("--base-output-directory", default="", help="the job's base_output_directory (backups)")
    st.add_argument("--run-name", default="", help="the job's run_name")
    st.add_argument("--replication-factor", type=int, default=2, help="copies a step should have (default 2)")
    st.add_argument("--verify", action="store_true",
                    help="have every host hash its blobs: a corrupt copy does not count (reads every byte)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=lambda a: __import__("mtc.head.tools.status", fromlist=["run"]).run(a))

    from mtc.head.tools import export_cmd

    export_cmd.add_parser(sub)

    rv = sub.add_parser(
        "restore-version", help="pin restore to one backup (restore.version)",
        description="Show the backups and the restore.version file, pin restore to one backup "
                    "(set NAME), or unpin it (clear). The backup root is "
                    "<base_output_directory>/<run_name>/mtc, or --backup-root.")
    rv.add_argument("action", choices=["show", "set", "clear"])
    rv.add_argument("name", nargs="?", help="backup name, as `show` lists it (for set)")
    rv.add_argument("--backup-root", help="backup root URL or path (gs://bucket/run/mtc or a directory)")
    rv.add_argument("--base-output-directory", default="", help="MaxText base_output_directory")
    rv.add_argument("--run-name", default="", help="MaxText run_name")
    rv.set_defaults(func=_cmd_restore_version)

    _add_manifests_parser(sub)
    return parser


def _add_manifests_parser(sub: argparse._SubParsersAction) -> None:
    """`mtc manifests render`: the JobSet (and peer-token Secret) of a Pathways job with mtc."""
    from mtc.head.tools.manifests import DEFAULT_PEER_PORT, MACHINES

    manifests = sub.add_parser("manifests", help="Kubernetes manifests (JobSet) for a Pathways job",
                               description="Kubernetes manifests for a Pathways job that uses mtc.")
    msub = manifests.add_subparsers(dest="manifests_action", metavar="{render,check}", required=True)
    r = msub.add_parser(
        "render", help="print the JobSet and the peer-token Secret as YAML",
        description="Render a JobSet (jobset.x-k8s.io/v1alpha2) for a Pathways job with multi-tier "
                    "checkpointing: the head (your --command with the MaxText flags it lacks), one "
                    "worker job per slice, the colocated Python sidecar with the mtc image, the ramdisk "
                    "at local_checkpoint_directory, the peer port and a Secret with the peer token. "
                    "MaxText flags may be in --command or given here; conflicting values are an error.",
        epilog="example: mtc manifests render --name llama --base-output-directory gs://bucket/ckpt "
               "--compute-type ct5p-hightpu-4t --topology 2x2x4 --num-slices 2 --params 8e9 "
               "--command 'python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b steps=1000' "
               "| kubectl apply -f -")
    job = r.add_argument_group("job")
    job.add_argument("--name", required=True, help="JobSet name (also run_name unless --run-name is given)")
    job.add_argument("--namespace", default="", help="namespace of the JobSet and Secret (default: kubectl's)")
    job.add_argument("--command", required=True,
                     help="the training command, run with bash -c; MaxText flags it lacks are appended")
    job.add_argument("--mtc-launcher", action="store_true",
                     help="run MaxText through mtc: 'python3 -m maxtext.trainers.pre_train.train' in --command "
                          "becomes 'python3 -m mtc.head.maxtext' (mtc as MaxText's multi-tier manager)")
    job.add_argument("--max-restarts", type=int, default=4,
                     help="JobSet restarts on failure (default 4); each restart restores from the ramdisks")
    job.add_argument("--image", default="",
                     help="head image (MaxText and mtc); default mtc-head:<mtc>-python_X.Y-jax_X.Y.Z")
    job.add_argument("--sidecar-image", "--pathways-colocated-python-sidecar-image", dest="sidecar_image",
                     default="", help="colocated Python sidecar image: the Pathways colocated Python server "
                                      "with mtc (images/build.py --colocated-base); default "
                                      "mtc-colocated-sidecar:<same tag as the head>; the cluster-mode "
                                      "mtc-sidecar image is refused")
    job.add_argument("--image-registry", default="", help="registry prefix of the default images")
    job.add_argument("--pathways-version", default="latest", help="tag of the Pathways server and proxy images")
    job.add_argument("--pathways-gcs-location", default="",
                     help="Pathways scratch location, gs://... (default: --base-output-directory)")

    tpu = r.add_argument_group("slices")
    tpu.add_argument("--compute-type", default="ct5p-hightpu-4t", metavar="TYPE",
                     help=f"TPU machine type: {', '.join(MACHINES)} (default ct5p-hightpu-4t)")
    tpu.add_argument("--topology", default="2x2x4", help="slice topology, e.g. 4x4 or 2x2x4 (default 2x2x4)")
    tpu.add_argument("--num-slices", type=int, default=None, help="number of slices (MaxText num_slices; default 1)")

    mt = r.add_argument_group("multi-tier checkpointing (MaxText flags)")
    mt.add_argument("--ramdisk-dir", "--gke-mtc-ramdisk-dir", dest="ramdisk_dir", default=None,
                    help="ramdisk mount path = local_checkpoint_directory (default /tmp/mtc_checkpoints)")
    mt.add_argument("--gke-mtc-enabled", action="store_true",
                    help="use GKE's multi-tier checkpointing CSI driver for the ramdisk (its size is set in "
                         "the cluster's CheckpointConfiguration) instead of a memory emptyDir")
    mt.add_argument("--params", type=_count, default=None,
                    help="model parameters (e.g. 70e9, 70B): sizes the emptyDir as `mtc size` does")
    mt.add_argument("--ramdisk-size", default="", help="emptyDir sizeLimit, e.g. 57Gi (checked against --params)")
    mt.add_argument("--local-checkpoint-period", type=int, default=None,
                    help="local_checkpoint_period in steps (default 10)")
    backup = mt.add_mutually_exclusive_group()
    backup.add_argument("--backup-interval-minutes", type=int, default=None,
                        help="multi_tier_checkpointing_backup_interval_minutes (default 30)")
    backup.add_argument("--backup-interval-steps", type=int, default=None,
                        help="multi_tier_checkpointing_backup_interval_steps (instead of minutes)")
    mt.add_argument("--base-output-directory", default="",
                    help="base_output_directory, e.g. gs://bucket/checkpoints (backups: <it>/<run_name>/mtc)")
    mt.add_argument("--run-name", default="", help="run_name (default --name)")

    r.add_argument("--preemption-grace-s", type=float, default=None, metavar="S",
                   help="seconds from a SIGTERM to the exit, for saving the step reached (MTC_PREEMPTION_GRACE_S, "
                        "default 25); the pods' terminationGracePeriodSeconds is set above it")
    peer = r.add_argument_group("peer tier")
    peer.add_argument("--peer-port", type=int, default=DEFAULT_PEER_PORT,
                      help=f"port of the sidecars' peer service on each host (default {DEFAULT_PEER_PORT})")
    token = peer.add_mutually_exclusive_group()
    token.add_argument("--peer-token-secret", default="", metavar="NAME",
                       help="use this existing Secret (key 'token'); no Secret is rendered")
    token.add_argument("--peer-token-file", type=Path, default=None, metavar="FILE",
                       help="put the token in this file into the rendered Secret (default: a random one)")

    r.add_argument("--output", "-o", type=Path, default=None, metavar="FILE",
                   help="write the YAML here (mode 0600: it holds the token) instead of stdout")
    r.set_defaults(func=_cmd_manifests)

    c = msub.add_parser(
        "check", help="validate a JobSet edited by hand",
        description="Validate a JobSet file (and the Secret beside it): the JobSet CRD schema (strict: unknown "
                    "fields are problems), kubernetes-validate for the core kinds and every pod template, and "
                    "mtc's rules: the ramdisk is mounted in the sidecar at local_checkpoint_directory, the sidecar "
                    "image carries the head image's versions (as mtc images check), the peer token's Secret is in "
                    "the file or named with --peer-token-secret, and a memory emptyDir's sizeLimit is at least "
                    "what mtc size gives for --params. Each problem on its own line; exit 1 when there is one.",
        epilog="example: mtc manifests render ... --params 8e9 > job.yaml; (edit job.yaml); "
               "mtc manifests check job.yaml --params 8e9")
    c.add_argument("file", type=Path, help="the YAML file (- for standard input)")
    c.add_argument("--params", type=_count, default=None,
                   help="model parameters (e.g. 8e9, 70B): the emptyDir sizeLimit must hold what mtc size gives")
    c.add_argument("--peer-token-secret", default="", metavar="NAME",
                   help="a Secret with the peer token that exists in the cluster (not in FILE)")
    c.add_argument("--kubernetes-version", default=None, metavar="X.Y",
                   help="the cluster's Kubernetes version for kubernetes-validate (default 1.32)")
    c.set_defaults(func=_cmd_manifests_check)


def _count(text: str) -> float:
    """A number, with an optional K/M/B/T suffix: ``70e9``, ``70B``, ``1.5T``."""
    t = text.strip().lower()
    scale = 1
    if t and t[-1] in _SUFFIXES:
        t, scale = t[:-1], _SUFFIXES[t[-1]]
    try:
        return float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number (e.g. 70e9 or 70B)") from None


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--params -70e9`` as ``--params=-70e9``: argparse takes "-70e9" for an option (only plain
    negative numbers like -70 are values to it) and answers "expected one argument"; joined, the
    value reaches its check, which says what is wrong with it."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(a) > 1 and a[0] == "-" and (
                a[1].isdigit() or a[1] == "."):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _cmd_size(args: argparse.Namespace) -> int:
    try:
        size = ramdisk_size(args.params, args.hosts, buffer=args.buffer,
                            bytes_per_param=args.bytes_per_param, steps_kept=args.steps_kept,
                            peer_copies=args.peer_copies)
    except ConfigError as e:
        print(f"mtc size: error: {e}", file=sys.stderr)
        return 2
    check = _check_ramdisk(args.ramdisk, size.required_bytes) if args.ramdisk is not None else None
    if check is not None and "error" in check:
        print(f"mtc size: error: {check['error']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**size.to_dict(), **({"ramdisk": check} if check else {})}, indent=2))
        return 1 if check and not check["fits"] else 0
    print("Ramdisk per host (MaxText multi-tier checkpointing guide):")
    for line in size.explain():
        print("  " + line)
    print(f"Ramdisk per host: {format_bytes(size.required_bytes)} "
          f"({size.required_bytes:,} bytes)")
    print(f"Kubernetes sizeLimit: {size.size_limit} (rounded up; "
          f"{size.size_limit_bytes:,} bytes)")
    if check is None:
        return 0
    print(f"Ramdisk {check['path']}: {check['fstype'] or 'unknown filesystem'} at {check['mountpoint'] or '?'}"
          f"{', huge=' + check['huge'] if check['huge'] else ''}, {format_bytes(check['total_bytes'])} in all, "
          f"{format_bytes(check['free_bytes'])} free")
    if check["advice"]:
        print(f"  advice: {check['advice']}")
    if not check["fits"]:
        print(f"mtc size: {check['path']} is too small: {format_bytes(size.required_bytes)} needed per host, "
              f"the filesystem holds {format_bytes(check['total_bytes'])}; raise the tmpfs size= "
              f"(Kubernetes: the emptyDir sizeLimit and the pod's memory limit)", file=sys.stderr)
        return 1
    print("  fits")
    return 0


def _check_ramdisk(path: Path, required: int) -> dict:
    """The mount, room and advice for ramdisk directory ``path`` (``{"error"}`` if unreadable)."""
    from mtc.shared import ramdisk

    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # a directory mtc would create: measure the filesystem it would be on
    if path.exists() and not path.is_dir():
        return {"error": f"--ramdisk {path} is not a directory"}
    if probe != path:
        m = ramdisk.describe(probe)
        if not (m and m.fstype == "tmpfs"):  # created on a disk, not in a ramdisk: almost surely a typo
            return {"error": f"--ramdisk {path} does not exist, and would be created on {probe} "
                             f"({m.fstype if m else 'unknown filesystem'}), which is not a ramdisk; mount the "
                             "ramdisk (e.g. mount -t tmpfs -o size=64g,huge=within_size tmpfs DIR) and pass its path"}
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return {"error": f"cannot read the filesystem of {path}: {e}"}
    m = ramdisk.describe(path)
    total = st.f_blocks * st.f_frsize
    return {"path": str(path), "mountpoint": m.mountpoint if m else "", "fstype": m.fstype if m else "",
            "huge": m.huge if m else "", "total_bytes": total, "free_bytes": st.f_bavail * st.f_frsize,
            "fits": total >= required, "advice": ramdisk.advice(path)}


def _cmd_demo(args: argparse.Namespace) -> int:
    args.created_workdir = args.workdir is None
    if args.workdir is None:  # on the machine's ramdisk when it has one, as a real job would be
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        args.workdir = Path(tempfile.mkdtemp(prefix="mtc-demo-", dir=shm))
    # Imported on use: only this command needs the demo (and whatever it imports).
    from mtc.head.tools import demo

    rc = demo.main(args)
    return 0 if rc is None else int(rc)


_LABELS = (("mtc", "mtc.version"), ("protocol", "mtc.protocol"), ("python", "mtc.python"), ("jax", "mtc.jax"),
           ("jaxlib", "mtc.jaxlib"))


def _image_labels(engine: str, ref: str) -> dict[str, str]:
    """The labels of image ``ref`` in ``engine``'s local storage; ConfigError when it cannot say."""
    import shutil
    import subprocess

    if shutil.which(engine) is None:
        raise ConfigError(f"--engine {engine}: {engine} is not installed here; drop --engine to compare the tags only")
    try:
        out = subprocess.run([engine, "image", "inspect", ref], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{engine} image inspect {ref} did not answer in 120 s") from None
    if out.returncode != 0:
        try:
            answers = subprocess.run([engine, "info"], capture_output=True, timeout=60).returncode == 0
        except subprocess.TimeoutExpired:
            answers = False
        if not answers:
            raise ConfigError(f"--engine {engine}: {engine} does not answer here ({_last_line(Exception(out.stderr))});"
                              " start its engine, or drop --engine to compare the tags only")
        raise ConfigError(f"{engine} has no image {ref} ({_last_line(Exception(out.stderr))}); pull or build it "
                          "first (python images/build.py build), or drop --engine to compare the tags only")
    try:
        doc = json.loads(out.stdout)[0]
    except (ValueError, IndexError, KeyError) as e:
        raise ConfigError(f"{engine} image inspect {ref} gave no JSON ({e})") from None
    return (doc.get("Config") or {}).get("Labels") or doc.get("Labels") or {}


def _cmd_images_check(args: argparse.Namespace) -> int:
    from mtc.head.tools import manifests

    try:
        bad = manifests.image_mismatches(args.head_image, args.sidecar_image)
        labels = ({role: _image_labels(args.engine, ref) for role, ref in
                   (("head", args.head_image), ("sidecar", args.sidecar_image))} if args.engine else None)
    except ConfigError as e:
        print(f"mtc images check: error: {e}", file=sys.stderr)
        return 2
    hv, sv = manifests.image_versions(args.head_image), manifests.image_versions(args.sidecar_image)
    print(f"{'':8} {'head':24} {'sidecar':24}")
    for k in ("mtc", "python", "jax"):
        mark = "  <- differs" if hv[k] != sv[k] else ""
        print(f"{k:8} {hv[k]:24} {sv[k]:24}{mark}")
    problems = []
    if bad:
        problems.append("the head and sidecar images differ (" + ", ".join(k for k, _, _ in bad) + "); build both "
                        "from the same lock (python images/build.py build) and use the same tag")
    if labels is not None:
        print(f"labels ({args.engine}):")
        for k, label in _LABELS:
            h, s = labels["head"].get(label, "-"), labels["sidecar"].get(label, "-")
            print(f"{k:8} {h:24} {s:24}{'  <- differs' if h != s else ''}")
        differ = [k for k, label in _LABELS if labels["head"].get(label) != labels["sidecar"].get(label)]
        if differ:
            problems.append(f"the images' labels differ ({', '.join(differ)}): they were built from different locks")
        missing = [f"{role} {label}" for role in labels for _, label in _LABELS if label not in labels[role]]
        if missing:
            problems.append(f"labels missing ({', '.join(missing)}): build the images with python images/build.py "
                            "build")
        for role, ref, tagged in (("head", args.head_image, hv), ("sidecar", args.sidecar_image, sv)):
            lied = [f"{k}: tag {tagged[k]}, label {labels[role].get(label)}" for k, label in _LABELS
                    if k in tagged and label in labels[role] and labels[role][label] != tagged[k]]
            if lied:
                problems.append(f"the {role} image {ref} is tagged with other versions than its labels say ("
                                + "; ".join(lied) + "): retag it with python images/build.py tags")
    if problems:
        for p in problems:
            print(f"mtc images check: {p}", file=sys.stderr)
        return 1
    print("ok: the images carry the same mtc, python and jax" + (" (tags and labels)" if labels else ""))
    return 0


def _duration(text: str) -> float:
    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(t[-1:], None)
    try:
        return float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise ConfigError(f"--mtbf {text!r} is not a duration (e.g. 1h, 30m, 3600)") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from mtc.head.tools import plan as planner

    def fail(msg: str) -> int:
        print(f"mtc plan: error: {msg}", file=sys.stderr)
        return 2

    notes: list[str] = []
    try:
        mtbf = _duration(args.mtbf)
        if args.params <= 0 or args.hosts < 1 or args.slices < 1 or args.step_time <= 0:
            return fail("--params, --hosts, --slices and --step-time must be positive")
        per_host = args.params * args.bytes_per_param / args.hosts
        if args.costs:
            vals = [float(v) for v in args.costs.split(",")]
            if len(vals) != 6:
                return fail("--costs takes 6 numbers: blocked,write,backup,restore_ram,restore_peer,restore_backup")
            costs, how = planner.Costs(*vals), "given (--costs)"
        elif args.rates or args.measure:
            if args.measure:
                r = planner.measure_rates()
                lo, hi = r.pop("_spread")["d2h"]
                how = "measured with mtc on this machine (--measure)"
                if hi > 1.5 * lo:
                    notes.append(f"the device-to-host rate varied from {lo:.2f} to {hi:.2f} GB/s over the last saves "
                                 "(a busy machine?): the recommendation moves with it; measure again when the machine "
                                 "is quiet, or give --rates")
            else:
                vals = [float(v) for v in args.rates.split(",")]
                if len(vals) != 6 or min(vals) <= 0:
                    return fail("--rates takes 6 positive GB/s: d2h,write,backup,ram_read,peer,backup_read")
                r = dict(zip(("d2h", "write", "backup", "ram_read", "peer", "backup_read"), vals))
                how = "from the rates given (--rates)"
            costs = planner.costs_from_rates(per_host, d2h_gbps=r["d2h"], write_gbps=r["write"],
                                             backup_gbps=r["backup"], ram_read_gbps=r["ram_read"],
                                             peer_gbps=r["peer"], backup_read_gbps=r["backup_read"])
            how += " (GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) + ")"
        else:
            return fail("give the costs: --measure (measure them here), --rates or --costs")
        p = planner.plan(costs, mtbf_s=mtbf, backup_fraction=args.backup_fraction, peer_fraction=args.peer_fraction,
                         backup_overhead=args.backup_overhead)
    except (ConfigError, ValueError) as e:
        return fail(str(e))
    if p.goodput <= 0:
        return fail(f"with a failure every {mtbf:g} s this job makes no progress under any checkpoint interval "
                    f"(a local save blocks {costs.local_blocked_s:.2f} s and takes {costs.local_write_s:.2f} s, a restore "
                    f"from RAM {costs.restore_ram_s:.2f} s): the MTBF must be much longer than these; check --mtbf "
                    "(e.g. 1h, 30m)")
    if math.isfinite(p.backup.interval_s) and p.local.interval_s > p.backup.interval_s:
        notes.append(f"local checkpoints would be rarer (every {p.local.interval_s:.0f} s) than backups (every "
                     f"{p.backup.interval_s:.0f} s): the local save's blocked time ({costs.local_blocked_s:.2f} s) is "
                     "large against the backup's charged overhead; check the costs (a busy machine measures slow "
                     "copies), or raise --backup-overhead")
    period = max(1, round(p.local.interval_s / args.step_time))
    minutes = max(1, math.ceil(p.backup.interval_s / 60)) if math.isfinite(p.backup.interval_s) else None
    print(f"{args.params:.3g} parameters x {args.bytes_per_param:g} B over {args.hosts} hosts per slice "
          f"({args.slices} slice(s)): {format_bytes(int(per_host))} per host; MTBF {mtbf:.0f} s; "
          f"{args.backup_fraction:.0%} of failures need the backup, {args.peer_fraction:.0%} of the rest a peer")
    print(f"costs per host, {how}:")
    for name, v in dataclasses.asdict(costs).items():
        print(f"  {name:18} {v:9.2f} s")
    print("recommended:")
    print(f"  local_checkpoint_period={period}  (every {p.local.interval_s:.0f} s = sqrt(2 x blocked x MTBF_local), "
          f"at {args.step_time:g} s a step)")
    print("  multi_tier_checkpointing_backup_interval_minutes=" + (f"{minutes}" if minutes else "none (no failure "
          "needs it)") + (f"  (every {p.backup.interval_s:.0f} s = sqrt(2 x overhead x upload x MTBF_backup), "
                          "at least one upload)" if minutes else ""))
    print("expected goodput (1 - sum over tiers of cost/tau + (tau/2 + restore)/MTBF_tier):")
    print(f"  mtc (RAM + peers + backup)  {p.goodput:8.2%}")
    print(f"  backup only                 {p.backup_only_goodput:8.2%}  (checkpoints every "
          f"{p.backup_only_interval_s:.0f} s, every failure restores from the bucket)")
    print(f"  blocking saves              {p.blocking_goodput:8.2%}  (training waits for each local write and "
          "each backup)")
    for n in notes:
        print(f"warning: {n}", file=sys.stderr)
    return 0


def _cmd_restore_version(args: argparse.Namespace) -> int:
    from mtc.shared import backup_layout as layout
    from mtc.shared.config import MTCConfig
    from mtc.shared.objstore import ObjectNotFoundError, StoreError, open_store

    try:
        root = args.backup_root or MTCConfig(base_output_directory=args.base_output_directory,
                                             run_name=args.run_name).backup_root
        store = open_store(root)
    except ConfigError as e:
        print(f"mtc restore-version: error: {e} (or pass --backup-root)", file=sys.stderr)
        return 2
    except Exception as e:  # a client library's error (credentials, a missing package): its message, no traceback
        print(f"mtc restore-version: error: cannot open {root}: {type(e).__name__}: {_last_line(e)}"
              + (_GCS_HINT if str(root).startswith("gs://") else ""), file=sys.stderr)
        return 1
    try:
        names = layout.names_from_listing(store.list(layout.BACKUPS))
        held = [] if names else store.list("")
        if not names and not held:
            print(f"mtc restore-version: error: the backup root {root} does not exist or is empty: nothing was "
                  "backed up there; check --base-output-directory and --run-name (backups go to "
                  "<base_output_directory>/<run_name>/mtc)", file=sys.stderr)
            return 1
        if not names and args.action != "clear":
            tops = sorted({str(k).split("/")[0] for k in held})
            inner = sorted({str(k).split("/")[0] for k in held if f"/{layout.BACKUPS}" in f"/{k}"})
            hint = (f"; the backups are one level down: --backup-root {str(root).rstrip('/')}/{inner[0]}"
                    if len(inner) == 1 and inner[0] != layout.BACKUPS else "")
            print(f"mtc restore-version: error: {root} holds no backups (no {layout.BACKUPS} in it); it holds "
                  f"{', '.join(tops[:8])}{' ...' if len(tops) > 8 else ''}{hint}", file=sys.stderr)
            return 1
        try:
            current = store.get_bytes(layout.RESTORE_VERSION).decode().strip()
        except ObjectNotFoundError:
            current = None
        if args.action == "show":
            print(f"backups in {root} (newest first):")
            for n in names:
                print(f"  {n}  step {layout.parse_backup_name(n)}" + ("  <- restore.version" if n == current else ""))
            if not names:
                print("  (none)")
            print(f"restore.version: {current if current else 'not set (restore takes the newest step)'}")
            if current and current not in names:
                print("warning: restore.version names a backup that does not exist; restore will fail "
                      "until it is fixed or cleared", file=sys.stderr)
            return 0
        if args.action == "clear":
            if current is None:
                print(f"restore.version is not set in {root}; nothing to remove (restore takes the newest step)")
                return 0
            store.delete(layout.RESTORE_VERSION)
            print(f"restore.version removed from {root}: restore takes the newest step")
            return 0
        if not args.name:
            print("mtc restore-version set: give the backup NAME (see `mtc restore-version show`)", file=sys.stderr)
            return 2
        try:
            layout.parse_backup_name(args.name)
        except ConfigError as e:
            print(f"mtc restore-version: error: {e}", file=sys.stderr)
            return 2
        if args.name not in names:
            print(f"mtc restore-version: error: no backup {args.name!r} in {root}; "
                  f"backups: {', '.join(names[:5]) or 'none'}", file=sys.stderr)
            return 2
        store.put_bytes(layout.RESTORE_VERSION, (args.name + "\n").encode())
        print(f"restore.version in {root} now pins {args.name} (step {layout.parse_backup_name(args.name)})")
        return 0
    except StoreError as e:
        print(f"mtc restore-version: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # e.g. google.auth errors while listing a gs:// root
        print(f"mtc restore-version: error: {root}: {type(e).__name__}: {_last_line(e)}"
              + (_GCS_HINT if str(root).startswith("gs://") else ""), file=sys.stderr)
        return 1
    finally:
        store.close()


_GCS_HINT = ("; for gs:// the google-cloud-storage client needs credentials (gcloud auth application-default "
             "login, or GOOGLE_APPLICATION_CREDENTIALS) and pip install 'mtc[gcs]'; STORAGE_EMULATOR_HOST points it "
             "at an emulator")


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else "(no message)"


def _cmd_manifests(args: argparse.Namespace) -> int:
    from mtc.head.tools import manifests

    def fail(message: str) -> int:
        print(f"mtc manifests render: error: {message}", file=sys.stderr)
        return 2

    token = ""
    if args.peer_token_file is not None:
        try:
            token = args.peer_token_file.read_text().strip()
        except OSError as e:
            return fail(f"--peer-token-file: cannot read {args.peer_token_file}: {e.strerror}")
    options = manifests.ManifestOptions(
        name=args.name, command=args.command, base_output_directory=args.base_output_directory,
        namespace=args.namespace, run_name=args.run_name, compute_type=args.compute_type,
        topology=args.topology, num_slices=args.num_slices, ramdisk_dir=args.ramdisk_dir,
        gke_mtc_enabled=args.gke_mtc_enabled, params=args.params, ramdisk_size=args.ramdisk_size,
        local_checkpoint_period=args.local_checkpoint_period,
        backup_interval_minutes=args.backup_interval_minutes, backup_interval_steps=args.backup_interval_steps,
        peer_port=args.peer_port, peer_token=token, peer_token_secret=args.peer_token_secret,
        image=args.image, sidecar_image=args.sidecar_image, image_registry=args.image_registry,
        pathways_version=args.pathways_version, pathways_gcs_location=args.pathways_gcs_location,
        max_restarts=args.max_restarts, mtc_launcher=args.mtc_launcher,
        preemption_grace_s=args.preemption_grace_s if args.preemption_grace_s is not None else DEFAULT_GRACE_S)
    try:
        text = manifests.to_yaml(manifests.render_documents(manifests.with_peer_token(options)))
    except ConfigError as e:
        return fail(str(e))
    except ImportError as e:
        return fail(str(e))
    if args.output is None:
        sys.stdout.write(text)
        return 0
    # Written whole or not at all, and readable only by its owner: it holds the peer token.
    out = args.output
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent if str(out.parent) else ".")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except OSError as e:
        return fail(f"--output: cannot write {out}: {e.strerror or e}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_manifests_check(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"mtc manifests check: error: {message}", file=sys.stderr)
        return 2

    name = "standard input" if str(args.file) == "-" else str(args.file)
    try:
        text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        return fail(f"cannot read {name}: {getattr(e, 'strerror', None) or e}")
    if args.params is not None and args.params <= 0:
        return fail(f"--params={args.params:g} must be more than 0 (the model's parameters, e.g. 8e9)")
    try:
        from mtc.head.tools import manifest_check

        options = {"params": args.params, "peer_token_secret": args.peer_token_secret}
        if args.kubernetes_version:
            options["kubernetes_version"] = args.kubernetes_version
        report = manifest_check.check_text(text, **options)
    except ImportError as e:  # manifest_check's own message names what to install
        return fail(str(e) if "mtc[k8s]" in str(e) else f"{e}; checking manifests needs pip install 'mtc[k8s]'")
    except Exception as e:  # e.g. kubernetes-validate without a schema for --kubernetes-version
        return fail(f"{type(e).__name__}: {getattr(e, 'message', None) or _last_line(e)}")
    for note in report.notes:
        print(f"note: {note}")
    for problem in report.problems:
        print(f"{name}: {problem}")
    if report.problems:
        print(f"mtc manifests check: {len(report.problems)} problem(s) in {name}", file=sys.stderr)
        return 1
    print(f"ok: {name} passes the JobSet CRD schema, kubernetes-validate and mtc's rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
