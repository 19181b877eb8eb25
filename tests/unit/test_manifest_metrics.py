"""`mtc manifests render --metrics-port`: the head serves /metrics and a PodMonitoring has GKE's managed
Prometheus scrape it; the PodMonitoring passes its schema (tests/data/k8s/podmonitoring-v1.schema.json,
shipped gzipped for `mtc manifests check`) and the JobSet still passes its own."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import pytest

from mtc.head.tools.k8s import check as manifest_check
from mtc.head.tools.k8s.manifests import render_documents
from mtc.head.tools.k8s.options import ManifestOptions
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
COMMAND = "python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b steps=100"


def render(**kw) -> list[dict]:
    return render_documents(ManifestOptions(name="llama", command=COMMAND, base_output_directory="gs://bucket/ckpt",
                                            params=8e9, peer_token="0123456789abcdef0123456789abcdef", **kw))


def test_the_shipped_schema_is_the_one_in_tests_data():
    shipped = resources.files("mtc.head.tools.k8s").joinpath("schemas", manifest_check.PODMONITORING_SCHEMA_FILE)
    assert json.loads(gzip.decompress(shipped.read_bytes())) == json.loads((DATA / "podmonitoring-v1.schema.json").read_text())


def test_metrics_port_renders_a_pod_monitoring_of_the_head_that_passes_the_checks():
    docs = render(metrics_port=9431)
    assert [d["kind"] for d in docs] == ["Secret", "JobSet", "PodMonitoring"]
    report = manifest_check.check_documents(docs, params=8e9)
    assert report.problems == [] and not any("not checked" in n for n in report.notes), report
    pm = docs[2]
    assert pm["apiVersion"] == "monitoring.googleapis.com/v1"
    # It selects the head pod by the labels the JobSet controller puts on it, and scrapes the port the
    # head's main container names "metrics", where MTC_METRICS_PORT has the head serve.
    head = next(rj for rj in docs[1]["spec"]["replicatedJobs"]
                if rj["name"] == pm["spec"]["selector"]["matchLabels"]["jobset.sigs.k8s.io/replicatedjob-name"])
    assert pm["spec"]["selector"]["matchLabels"]["jobset.sigs.k8s.io/jobset-name"] == docs[1]["metadata"]["name"]
    main = next(c for c in head["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "main")
    port = next(p for p in main["ports"] if p["name"] == pm["spec"]["endpoints"][0]["port"])
    assert port["containerPort"] == 9431
    assert {"name": "MTC_METRICS_PORT", "value": "9431"} in main["env"]


def test_without_metrics_port_no_pod_monitoring_and_no_port():
    docs = render()
    assert [d["kind"] for d in docs] == ["Secret", "JobSet"]
    assert "MTC_METRICS_PORT" not in json.dumps(docs)


@pytest.mark.parametrize("change, message", [
    (lambda pm: pm["spec"]["endpoints"][0].update(intervall="30s"), "Additional properties are not allowed"),
    (lambda pm: pm["spec"]["endpoints"][0].update(interval="30 seconds"), "does not match"),
    (lambda pm: pm["spec"].pop("selector"), "'selector' is a required property"),
    (lambda pm: pm["spec"]["endpoints"][0].pop("port"), "'port' is a required property"),
])
def test_a_broken_pod_monitoring_is_a_problem(change, message):
    docs = render(metrics_port=9431)
    change(docs[2])
    problems = manifest_check.check_documents(docs, params=8e9).problems
    assert len(problems) == 1 and "PodMonitoring llama-mtc-metrics" in problems[0] and message in problems[0], problems


@pytest.mark.parametrize("port, what", [(29010, "peer service"), (29000, "Pathways"), (70000, "out of range")])
def test_a_metrics_port_that_clashes_is_refused_by_name(port, what):
    with pytest.raises(ConfigError, match=f"--metrics-port={port} .*{what}"):
        render(metrics_port=port)
