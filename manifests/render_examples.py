"""Regenerate the rendered examples in manifests/examples/ (a test keeps them in sync):

    python manifests/render_examples.py

Each example is ``mtc manifests render`` with the options below. They name their images and an
existing peer-token Secret, so the output does not depend on this machine's versions nor hold a
token (create it first: kubectl create secret generic mtc-peer-token --from-literal=token=$(openssl rand -hex 32)).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

IMAGES = ["--image", "us-docker.pkg.dev/PROJECT/mtc/mtc-head:0.1.0-python_3.12-jax_0.12.0.1",
          "--sidecar-image", "us-docker.pkg.dev/PROJECT/mtc/mtc-colocated-sidecar:0.1.0-python_3.12-jax_0.12.0.1",
          "--peer-token-secret", "mtc-peer-token"]
GUIDE_COMMAND = ("python3 -m maxtext.trainers.pre_train.train maxtext/configs/base.yml run_name=llama3-8b "
                 "model_name=llama3.1-8b steps=10000 per_device_batch_size=1")

EXAMPLES = {
    # The MaxText guide's Pathways example: GKE's multi-tier checkpointing CSI driver for the ramdisk.
    "pathways-gke-csi.yaml": ["--name", "llama3-8b", "--base-output-directory", "gs://BUCKET/runs",
                              "--compute-type", "ct5p-hightpu-4t", "--topology", "2x2x4", "--num-slices", "2",
                              "--gke-mtc-enabled", "--ramdisk-dir", "/local", "--local-checkpoint-period", "20",
                              "--backup-interval-minutes", "30", "--mtc-launcher", "--command", GUIDE_COMMAND],
    # A cluster without the addon: the ramdisk is a memory emptyDir sized like `mtc size`.
    "pathways-memory-emptydir.yaml": ["--name", "llama3-8b", "--base-output-directory", "gs://BUCKET/runs",
                                      "--compute-type", "ct5p-hightpu-4t", "--topology", "2x2x4", "--num-slices",
                                      "2", "--params", "8e9", "--ramdisk-dir", "/local",
                                      "--local-checkpoint-period", "20", "--backup-interval-minutes", "30",
                                      "--mtc-launcher", "--command", GUIDE_COMMAND],
}


def render(name: str) -> str:
    """The YAML of example ``name``, as ``mtc manifests render`` prints it."""
    import contextlib
    import io

    from mtc.head.tools.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["manifests", "render", *EXAMPLES[name], *IMAGES])
    if rc != 0:
        raise SystemExit(f"rendering {name} failed ({rc})")
    return out.getvalue()


if __name__ == "__main__":
    (HERE / "examples").mkdir(exist_ok=True)
    for n in EXAMPLES:
        (HERE / "examples" / n).write_text(render(n))
        print(f"wrote manifests/examples/{n}")
    sys.exit(0)
