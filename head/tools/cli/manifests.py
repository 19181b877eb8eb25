"""``mtc manifests render`` (the JobSet of a Pathways job with mtc, as YAML) and ``mtc manifests
check FILE`` (a hand-edited JobSet against the schemas and mtc's rules)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from mtc.head.preemption import DEFAULT_GRACE_S
from mtc.shared.errors import ConfigError

from mtc.head.tools.cli.common import last_line


def cmd_manifests_render(args: argparse.Namespace) -> int:
    from mtc.head.tools.k8s import manifests
    from mtc.head.tools.k8s.options import ManifestOptions

    def fail(message: str) -> int:
        print(f"mtc manifests render: error: {message}", file=sys.stderr)
        return 2

    token = ""
    if args.peer_token_file is not None:
        try:
            token = args.peer_token_file.read_text().strip()
        except OSError as e:
            return fail(f"--peer-token-file: cannot read {args.peer_token_file}: {e.strerror}")
    options = ManifestOptions(
        name=args.name, command=args.command, base_output_directory=args.base_output_directory,
        namespace=args.namespace, run_name=args.run_name, compute_type=args.compute_type,
        topology=args.topology, num_slices=args.num_slices, ramdisk_dir=args.ramdisk_dir,
        gke_mtc_enabled=args.gke_mtc_enabled, params=args.params, ramdisk_size=args.ramdisk_size,
        local_checkpoint_period=args.local_checkpoint_period,
        backup_interval_minutes=args.backup_interval_minutes, backup_interval_steps=args.backup_interval_steps,
        peer_port=args.peer_port, peer_token=token, peer_token_secret=args.peer_token_secret,
        image=args.image, sidecar_image=args.sidecar_image, image_registry=args.image_registry,
        pathways_version=args.pathways_version, pathways_gcs_location=args.pathways_gcs_location,
        max_restarts=args.max_restarts, mtc_launcher=args.mtc_launcher, metrics_port=args.metrics_port,
        tls=not args.no_tls,
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


def cmd_manifests_check(args: argparse.Namespace) -> int:
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
        from mtc.head.tools.k8s import check

        options = {"params": args.params, "peer_token_secret": args.peer_token_secret}
        if args.kubernetes_version:
            options["kubernetes_version"] = args.kubernetes_version
        report = check.check_text(text, **options)
    except ImportError as e:  # the check module's own message names what to install
        return fail(str(e) if "mtc[k8s]" in str(e) else f"{e}; checking manifests needs pip install 'mtc[k8s]'")
    except Exception as e:  # e.g. kubernetes-validate without a schema for --kubernetes-version
        return fail(f"{type(e).__name__}: {getattr(e, 'message', None) or last_line(e)}")
    for note in report.notes:
        print(f"note: {note}")
    for problem in report.problems:
        print(f"{name}: {problem}")
    if report.problems:
        print(f"mtc manifests check: {len(report.problems)} problem(s) in {name}", file=sys.stderr)
        return 1
    print(f"ok: {name} passes the JobSet CRD schema, kubernetes-validate and mtc's rules")
    return 0
