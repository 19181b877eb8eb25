"""`mtc manifests render --metrics-port`: the head's /metrics address is said explicitly (every interface:
the PodMonitoring scrapes the pod's IP), and the rendered variables make the config the head builds."""

from __future__ import annotations

import pytest

from mtc.head.tools.k8s.manifests import render_documents
from mtc.head.tools.k8s.options import ManifestOptions
from mtc.shared.config import MTCConfig

pytestmark = pytest.mark.unit

COMMAND = "python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b steps=100"


def head_env(**kw) -> dict[str, str]:
    docs = render_documents(ManifestOptions(name="llama", command=COMMAND, base_output_directory="gs://bucket/ckpt",
                                            params=8e9, peer_token="0123456789abcdef0123456789abcdef", **kw))
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    for rj in jobset["spec"]["replicatedJobs"]:
        for c in rj["template"]["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "main":
                return {e["name"]: e["value"] for e in c["env"] if "value" in e}
    raise AssertionError("no main container")


def test_metrics_port_renders_the_address_every_interface():
    env = head_env(metrics_port=9431)
    assert env["MTC_METRICS_ADDRESS"] == "0.0.0.0"
    mtc_env = {k: v for k, v in env.items() if k in ("MTC_METRICS_PORT", "MTC_METRICS_ADDRESS")}
    cfg = MTCConfig.from_flags(["local_checkpoint_directory=/tmp/x"], environ=mtc_env)
    assert (cfg.metrics_port, cfg.metrics_address) == (9431, "0.0.0.0")


def test_no_metrics_port_no_address():
    assert "MTC_METRICS_ADDRESS" not in head_env()
