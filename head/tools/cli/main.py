"""The ``mtc`` command line.

Subcommands:

- ``mtc size --params 70e9 --hosts 32 [--ramdisk DIR]``: ramdisk size per host, with the steps of
  the calculation and a Kubernetes ``sizeLimit``; with ``--ramdisk``, whether DIR fits and is fast.
- ``mtc demo``: a small training run with a crash and a restore (``mtc.head.tools.demo``).
- ``mtc restore-version show|set|clear``: list backups and pin the one to restore.
- ``mtc manifests render ...``: the JobSet of a Pathways job with mtc (``mtc.head.tools.k8s.manifests``).
- ``mtc manifests check FILE``: a hand-edited JobSet against the schemas and mtc's rules
  (``mtc.head.tools.k8s.check``).
- ``mtc images check HEAD SIDECAR [--engine podman]``: the two images' versions (tags, labels).
- ``mtc verify --backup ...``: re-hash the backups' blobs in the store now, repair or mark damaged
  ones (``verify``).
- ``mtc tls generate DIR``: the job's CA and certificate for TLS in transit (``tls``).

This module builds the parser; each command's implementation is in a module of its own in this
package, named by the command: ``size``, ``plan``, ``images``, ``restore_version``, ``manifests``,
``tls``, ``status``, ``export``, ``verify``.

``python -m mtc.head.tools.cli ...`` works the same as ``mtc ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mtc.head.tools.cli.images import cmd_images_check
from mtc.head.tools.cli.manifests import cmd_manifests_check, cmd_manifests_render
from mtc.head.tools.cli.plan import cmd_plan
from mtc.head.tools.cli.restore_version import cmd_restore_version
from mtc.head.tools.cli.size import cmd_size

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Usage errors (bad options or values) return 2 rather than raising SystemExit, so the
    function can be called in-process.
    """
    parser = build_parser()
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the command they were given to, with its usage and the option meant
            _unrecognized(parser, argv, extra)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


def _unrecognized(parser: argparse.ArgumentParser, argv: Sequence[str], extra: Sequence[str]) -> None:
    """Exit 2 with the usage of the (sub)command the unknown arguments were given to, naming the
    option each one most likely meant (argparse itself would show the top-level usage alone)."""
    import difflib

    target = parser
    for token in argv:  # the deepest subcommand named: `mtc restore-version set ...`
        subs = [a for a in target._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            target = subs[0].choices[token]
    options = [o for action in target._actions for o in action.option_strings]
    hints = []
    for x in extra:
        near = difflib.get_close_matches(x.split("=", 1)[0], options, n=1, cutoff=0.6) if x.startswith("-") else []
        if near:
            hints.append(f"{x}: did you mean {near[0]}?")
    target.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


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
    size.set_defaults(func=cmd_size)

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
    demo.add_argument("--timeline", type=Path, default=None,
                      help="where to write the timeline picture (default demo-out/timeline.png; with --quick "
                           "demo-out/timeline-quick.png, so the full run's stays)")
    demo.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                      help="serve the head's Prometheus metrics on this port while the demo runs (default: "
                           "MTC_METRICS_PORT, else none): curl -s localhost:PORT/metrics")
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
    pl.add_argument("--restart", default="0",
                    help="what every failure costs besides its restore: detection, the new process, imports, "
                         "compilation, the first step (e.g. 30s; bench/bench_goodput.py measures it; default 0)")
    pl.add_argument("--backup-overhead", type=float, default=0.05,
                    help="share of a background upload's duration charged to training (default 0.05)")
    src = pl.add_mutually_exclusive_group()
    src.add_argument("--measure", action="store_true", help="measure the rates with mtc on this machine")
    src.add_argument("--rates", help="GB/s per host: d2h,write,backup,ram_read,peer,backup_read")
    src.add_argument("--costs", help="seconds per host: blocked,write,backup,restore_ram,restore_peer,restore_backup")
    pl.set_defaults(func=cmd_plan)

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
    ic.set_defaults(func=cmd_images_check)

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
    st.set_defaults(func=lambda a: __import__("mtc.head.tools.cli.status", fromlist=["run"]).run(a))

    from mtc.head.tools.cli import export, verify

    export.add_parser(sub)
    verify.add_parser(sub)

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
    rv.set_defaults(func=cmd_restore_version)

    _add_manifests_parser(sub)
    from mtc.head.tools.cli import tls

    tls.add_parser(sub)
    return parser


def _add_manifests_parser(sub: argparse._SubParsersAction) -> None:
    """`mtc manifests render`: the JobSet (and peer-token Secret) of a Pathways job with mtc."""
    from mtc.head.tools.k8s.options import DEFAULT_PEER_PORT, MACHINES

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
    r.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the head's Prometheus metrics on this port (MTC_METRICS_PORT) and render a PodMonitoring "
                        "for GKE's managed Prometheus (default 0: neither)")
    peer.add_argument("--no-tls", action="store_true",
                      help="no TLS in transit (default: mount the Secret NAME-mtc-tls with ca.crt, tls.crt and "
                           "tls.key into the head and the sidecars and set MTC_TLS_DIR; make it with "
                           "`mtc tls generate DIR` and `kubectl create secret generic NAME-mtc-tls --from-file=...`)")
    token = peer.add_mutually_exclusive_group()
    token.add_argument("--peer-token-secret", default="", metavar="NAME",
                       help="use this existing Secret (key 'token'); no Secret is rendered")
    token.add_argument("--peer-token-file", type=Path, default=None, metavar="FILE",
                       help="put the token in this file into the rendered Secret (default: a random one)")

    r.add_argument("--output", "-o", type=Path, default=None, metavar="FILE",
                   help="write the YAML here (mode 0600: it holds the token) instead of stdout")
    r.set_defaults(func=cmd_manifests_render)

    c = msub.add_parser(
        "check", help="validate a JobSet edited by hand",
        description="Validate a JobSet file (and the Secret beside it): the JobSet CRD schema (strict: unknown "
                    "fields are problems), kubernetes-validate for the core kinds and every pod template, and "
                    "mtc's rules: the ramdisk is mounted in the sidecar at local_checkpoint_directory, the sidecar "
                    "image carries the head image's versions (as mtc images check), the peer token's Secret is in "
                    "the file or named with --peer-token-secret, a memory emptyDir's sizeLimit is at least "
                    "what mtc size gives for --params, and what render refuses (grace periods above "
                    "MTC_PREEMPTION_GRACE_S, ports, MTC_METRICS_PORT and the PodMonitoring, one TLS Secret for "
                    "the head and the sidecars). Each problem on its own line; exit 1 when there is one.",
        epilog="example: mtc manifests render ... --params 8e9 > job.yaml; (edit job.yaml); "
               "mtc manifests check job.yaml --params 8e9")
    c.add_argument("file", type=Path, help="the YAML file (- for standard input)")
    c.add_argument("--params", type=_count, default=None,
                   help="model parameters (e.g. 8e9, 70B): the emptyDir sizeLimit must hold what mtc size gives")
    c.add_argument("--peer-token-secret", default="", metavar="NAME",
                   help="a Secret with the peer token that exists in the cluster (not in FILE)")
    c.add_argument("--kubernetes-version", default=None, metavar="X.Y",
                   help="the cluster's Kubernetes version for kubernetes-validate (default 1.32)")
    c.set_defaults(func=cmd_manifests_check)


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


def _cmd_demo(args: argparse.Namespace) -> int:
    args.created_workdir = args.workdir is None
    if args.workdir is None:  # on the machine's ramdisk when it has one, as a real job would be
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        args.workdir = Path(tempfile.mkdtemp(prefix="mtc-demo-", dir=shm))
    # Imported on use: only this command needs the demo (and whatever it imports).
    from mtc.head.tools import demo

    rc = demo.main(args)
    return 0 if rc is None else int(rc)

