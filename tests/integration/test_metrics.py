"""Prometheus metrics of the head, scraped from the real HTTP endpoint while real sidecar daemons save,
one is killed with SIGKILL, a wiped host restores from its peers and a wiped cluster from the backup.

Each scrape is parsed with prometheus_client's own text parser; values are compared with the
manager's reports (bytes by tier, bit for bit what ``last_restore_report`` says) and with each other
(counts grow by one per save, the recovery points move as the tiers get new steps).
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from prometheus_client.parser import text_string_to_metric_families

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.head import metrics
from mtc.shared.errors import ConfigError, SaveError

pytestmark = pytest.mark.integration


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return {"w": jax.device_put(random_array(rng, (64, 48), np.float32), NamedSharding(mesh, P("data", "model"))),
            "v": jax.device_put(random_array(rng, (32, 48), np.float32), NamedSharding(mesh, P(None, "model"))),
            "step": seed}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape() -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    port = metrics.served_port()
    assert port, "the head serves no /metrics"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def val(scr: dict, name: str, **labels) -> float | None:
    return scr.get((name, tuple(sorted(labels.items()))))


def saves_counted(scr: dict) -> dict[str, float]:
    return {ph: val(scr, "mtc_save_duration_seconds_count", phase=ph) for ph in ("blocked", "write", "commit", "total")}


def restore_bytes(scr: dict) -> dict[str, float]:
    return {t: val(scr, "mtc_restore_bytes_total", tier=t) for t in ("ram", "peer", "backup")}


def config(cluster, ramdisk, port: int) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, prefetch_on_start=False, metrics_port=port,
                     base_output_directory=str(ramdisk / "bucket"), run_name="run",
                     multi_tier_checkpointing_backup_interval_steps=1)


def test_metrics_follow_saves_a_kill_and_restores_from_peers_and_backup(local_cluster, ramdisk):
    port = metrics.served_port() or free_port()  # one server per process: a second port would not be served
    states = {s: state(s) for s in (1, 2, 3, 4)}
    with CheckpointManager(config(local_cluster, ramdisk, port)) as m:
        first = scrape()
        assert val(first, "mtc_backups_running") == 0
        prev_rp = None
        for s in (1, 2):
            before = scrape()
            t_call = time.time()
            m.save(s, states[s])
            m.wait_until_finished()
            after = scrape()
            t_after = time.time()
            # One more observation of each save phase per save.
            assert {ph: n - saves_counted(before)[ph] for ph, n in saves_counted(after).items()} == dict.fromkeys(
                ("blocked", "write", "commit", "total"), 1.0)
            assert val(after, "mtc_saves_total") - val(before, "mtc_saves_total") == 1
            assert (val(after, "mtc_save_bytes_total", kind="state") - val(before, "mtc_save_bytes_total", kind="state")
                    == m.last_save_report.bytes_total)
            # The RAM tier holds the state save() took at t_call: its age is measured from then.
            rp = val(after, "mtc_recovery_point_seconds", tier="ram")
            assert m.last_save_report.total_s <= rp <= t_after - t_call
            if prev_rp is not None:
                assert rp < val(before, "mtc_recovery_point_seconds", tier="ram")  # it dropped at the commit
            # A callback gauge: it grows between scrapes.
            assert val(scrape(), "mtc_recovery_point_seconds", tier="ram") > rp
            rep = m.wait_for_replication()
            assert rep.replicated and rep.step == s
            assert m.wait_for_backup().error is None
            done = scrape()
            assert val(done, "mtc_replication_lag_seconds") == 0
            assert val(done, "mtc_save_duration_seconds_count", phase="replication") > val(
                before, "mtc_save_duration_seconds_count", phase="replication")
            assert val(done, "mtc_replication_copies_total") - val(before, "mtc_replication_copies_total") >= rep.moved_blobs
            assert val(done, "mtc_backups_total", outcome="ok") - (val(before, "mtc_backups_total", outcome="ok") or 0) == 1
            for tier in ("peer", "backup"):  # both hold step s now: the same age as RAM's
                assert val(done, "mtc_recovery_point_seconds", tier=tier) <= time.time() - t_call
            for h in local_cluster.hosts:  # each host's ramdisk, as the head's latest inventory found it
                st = os.statvfs(local_cluster.ramdisk(h))
                assert val(done, "mtc_host_up", host=h) == 1
                assert val(done, "mtc_host_ramdisk_size_bytes", host=h) == st.f_blocks * st.f_frsize
                assert 0 < val(done, "mtc_host_ramdisk_free_bytes", host=h) <= st.f_blocks * st.f_frsize
            prev_rp = rp

        # kill -9 of a sidecar daemon during the next save: the save fails, nothing reaches any tier.
        local_cluster.kill("s0-h1")
        before = scrape()
        assert m.save(3, states[3])
        with pytest.raises(SaveError):
            m.wait_until_finished()
        after = scrape()
        assert saves_counted(after) == saves_counted(before)
        assert val(after, "mtc_errors_total", op="save", type="SaveError") - (
            val(before, "mtc_errors_total", op="save", type="SaveError") or 0) == 1
        for tier in ("ram", "peer", "backup"):  # no newer step anywhere: every tier's age only grows
            assert val(after, "mtc_recovery_point_seconds", tier=tier) > val(before, "mtc_recovery_point_seconds", tier=tier)
        local_cluster.restart("s0-h1")
        m.save(4, states[4])
        m.wait_until_finished()
        assert m.wait_for_replication().replicated
        m.wait_for_backup()

        # A wiped host restores from its peers: the bytes by tier are the report's.
        local_cluster.wipe("s1-h0")
        local_cluster.restart("s1-h0")
        before = scrape()
        assert_trees_bitwise_equal(states[4], m.restore())
        rep = m.last_restore_report
        after = scrape()
        assert rep.bytes_by_tier["peer"] > 0 and rep.bytes_by_tier["backup"] == 0
        assert {t: after_n - restore_bytes(before)[t] for t, after_n in restore_bytes(after).items()} == rep.bytes_by_tier
        assert val(after, "mtc_restores_total", source="cluster") - (val(before, "mtc_restores_total", source="cluster")
                                                                     or 0) == 1
        assert val(after, "mtc_restore_duration_seconds_count", phase="total") - val(
            before, "mtc_restore_duration_seconds_count", phase="total") == 1

    # Every ramdisk lost: a new head (the same process, the same endpoint) restores from the backup.
    for h in local_cluster.hosts:
        local_cluster.wipe(h)
        local_cluster.restart(h)
    with CheckpointManager(config(local_cluster, ramdisk, port)) as m:
        before = scrape()
        assert_trees_bitwise_equal(states[4], m.restore())
        rep = m.last_restore_report
        after = scrape()
    assert rep.source != "cluster" and rep.bytes_by_tier["backup"] > 0 and rep.bytes_by_tier["peer"] == 0
    assert {t: n - restore_bytes(before)[t] for t, n in restore_bytes(after).items()} == rep.bytes_by_tier
    assert val(after, "mtc_restores_total", source="backup") - (val(before, "mtc_restores_total", source="backup") or 0) == 1


def test_save_records_orbax_jax_monitoring_events(ramdisk):
    """The save's blocking, commit and total durations go to jax.monitoring under Orbax's names, metrics on or off."""
    seen: list[tuple[str, float]] = []

    def listener(event: str, duration: float, **kw) -> None:
        seen.append((event, duration))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with CheckpointManager(local_checkpoint_directory=str(ramdisk), colocated_python_checkpointing=True,
                               local_checkpoint_period=1, prefetch_on_start=False) as m:
            m.save(1, state(1))
            m.wait_until_finished()
            report = m.last_save_report
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    got = dict(seen)
    assert got["/jax/checkpoint/write/async/blocking_duration_secs"] == report.blocked_s
    assert got["/jax/checkpoint/write/async/commit_duration_sec"] == report.phase2_s
    assert got["/jax/checkpoint/write/async/total_duration_secs"] == report.total_s


def test_a_bad_metrics_port_is_refused_by_name():
    with pytest.raises(ConfigError, match="metrics_port=70000 is out of range"):
        MTCConfig(local_checkpoint_directory="/tmp/x", metrics_port=70000)
    env = {"MTC_METRICS_PORT": "9400"}
    assert MTCConfig.from_flags(["local_checkpoint_directory=/tmp/x"], environ=env).metrics_port == 9400


def scrape_at(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_sidecar_metrics_of_a_real_daemon(inprocess_daemon, ramdisk):
    """A sidecar's /metrics: its ramdisk, steps and lease as the head's saves leave them, and the bytes
    its peer service sends to and receives from a real peer client."""
    import logging
    import os

    from mtc.sidecar.metrics import serve_metrics
    from mtc.sidecar.peer import PeerClient
    from mtc.sidecar.ram.store import RamStore

    svc, spec = inprocess_daemon()
    token = os.environ["MTC_PEER_TOKEN"]
    svc.start_peer_service(("127.0.0.1", 0), token)
    server = serve_metrics(0, svc, addr="127.0.0.1")
    try:
        h = {"host": "s0-h0"}
        empty = scrape_at(server.port)
        assert val(empty, "mtc_sidecar_ramdisk_used_bytes", **h) == 0
        assert val(empty, "mtc_sidecar_committed_steps", **h) == 0
        assert val(empty, "mtc_sidecar_newest_step", **h) is None
        with CheckpointManager(local_checkpoint_directory=str(ramdisk / "host"), cluster_spec=str(spec),
                               local_checkpoint_period=1, prefetch_on_start=False) as m:
            for s in (1, 2):
                m.save(s, state(s))
                m.wait_until_finished()
            got = scrape_at(server.port)
            assert val(got, "mtc_sidecar_lease_generation", **h) == svc.lease.current()["generation"]
        names = sorted(svc.store.blobs.names())
        on_disk = sum(svc.store.blobs.path(n).stat().st_size for n in names)
        assert val(got, "mtc_sidecar_ramdisk_used_bytes", **h) == on_disk > 0
        st = os.statvfs(svc.store.root)
        assert 0 < val(got, "mtc_sidecar_ramdisk_free_bytes", **h) <= val(got, "mtc_sidecar_ramdisk_total_bytes", **h)
        assert val(got, "mtc_sidecar_ramdisk_total_bytes", **h) == st.f_blocks * st.f_frsize
        assert val(got, "mtc_sidecar_committed_steps", **h) == 2 and val(got, "mtc_sidecar_newest_step", **h) == 2
        assert val(got, "mtc_sidecar_jobs_running", **h) == 0

        # A peer pulls every blob (out), then pushes one back after the host lost it (in).
        other = RamStore(ramdisk / "other" / "mtc")
        with PeerClient(svc.peer_address, token) as c:
            pulled = sum(c.get(other, n) for n in names)
            lost = names[0]
            svc.store.blobs.path(lost).unlink()
            assert c.put(other, lost)
        after = scrape_at(server.port)
        into = {"host": "s0-h0", "direction": "in"}
        assert val(after, "mtc_sidecar_peer_bytes_total", **into) - val(got, "mtc_sidecar_peer_bytes_total", **into) == (
            other.blobs.size(lost))
        assert svc.store.blobs.path(lost).stat().st_size == other.blobs.size(lost)
        assert pulled == on_disk
        out = {"host": "s0-h0", "direction": "out"}
        assert val(after, "mtc_sidecar_peer_bytes_total", **out) - val(got, "mtc_sidecar_peer_bytes_total", **out) == pulled
        assert val(after, "mtc_sidecar_peer_blobs_total", **out) - val(got, "mtc_sidecar_peer_blobs_total", **out) == len(names)
        with pytest.raises(ConfigError, match="MTC_PEER_TOKEN"):  # the wrong job token: refused
            PeerClient(svc.peer_address, "x" * 64).have(names[:1])
        assert val(scrape_at(server.port), "mtc_sidecar_peer_refused_total", **h) == val(
            after, "mtc_sidecar_peer_refused_total", **h) + 1
        # An object of shared storage that fails the job key's check is counted by kind.
        from mtc.shared import job_key

        kind = {"host": "s0-h0", "kind": "finalize marker"}
        before = val(after, "mtc_sidecar_untrusted_objects_total", **kind) or 0
        job_key.refuse("finalize marker", "finalizing/planted-by-a-metrics-test", job_key.UNSIGNED)
        assert val(scrape_at(server.port), "mtc_sidecar_untrusted_objects_total", **kind) == before + 1
        # Error records of mtc's loggers are counted by logger.
        logging.getLogger("mtc.sidecar.service").error("a test error record")
        errs = scrape_at(server.port)
        assert val(errs, "mtc_sidecar_errors_total", host="s0-h0", logger="mtc.sidecar.service") >= 1
        other.close()
    finally:
        server.close()
    with pytest.raises(OSError):
        scrape_at(server.port)


def test_a_fencing_is_counted_once_and_its_errors_by_type(local_cluster):
    """A second head takes the hosts: the first head's refused saves count as FencedError, the fencing once."""
    from mtc.shared.errors import FencedError

    port = metrics.served_port() or free_port()
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1, prefetch_on_start=False, metrics_port=port)
    first = CheckpointManager(cfg)
    second = None
    try:
        first.save(1, state(1))
        first.wait_until_finished()
        before = scrape()
        second = CheckpointManager(cfg)
        assert_trees_bitwise_equal(state(1), second.restore(1))  # the second head takes the hosts
        first.save(2, state(2))
        with pytest.raises(FencedError):
            first.wait_until_finished()
        with pytest.raises(FencedError):  # refused at once from now on
            first.save(3, state(3))
        after = scrape()
    finally:
        for m in (first, second):
            if m is not None:
                try:
                    m.close()
                except FencedError:
                    pass
    assert val(after, "mtc_fencing_events_total") - val(before, "mtc_fencing_events_total") == 1

    def fenced(scr, op):
        return val(scr, "mtc_errors_total", op=op, type="FencedError") or 0
    assert fenced(after, "save") - fenced(before, "save") == 2  # the background save, then save() itself
    assert saves_counted(after)["commit"] - saves_counted(before)["commit"] == 0  # the fenced save committed nothing


def test_sidecar_metrics_on_a_taken_port_say_which_and_the_fix(ramdisk):
    from mtc.sidecar.metrics import serve_metrics
    from mtc.sidecar.service import SidecarService

    svc = SidecarService(ramdisk / "h" / "mtc", host_id="s0-h0")
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            with pytest.raises(ConfigError, match=f"host s0-h0: cannot serve metrics on 127.0.0.1:{port}.*free port"):
                serve_metrics(port, svc, addr="127.0.0.1")
    finally:
        svc.close()


def test_a_sidecar_daemon_started_with_metrics_port_serves_them(ramdisk, tmp_path):
    """``python -m mtc.sidecar serve --metrics-port P``: the daemon process itself serves /metrics."""
    import os
    import subprocess
    import sys

    port = free_port()
    ready = tmp_path / "ready.json"
    env = {**os.environ, "MTC_PEER_TOKEN": "metrics-daemon-test-token-0123"}
    proc = subprocess.Popen([sys.executable, "-m", "mtc.sidecar", "serve", "--root", str(ramdisk / "d0"),
                             "--host-id", "s0-h0", "--ready-file", str(ready), "--metrics-port", str(port),
                             "--log-file", str(tmp_path / "d0.log")], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "d0.log").read_text()
            time.sleep(0.05)
        scr = scrape_at(port)
        assert val(scr, "mtc_sidecar_committed_steps", host="s0-h0") == 0
        assert any(name.startswith("mtc_sidecar_ramdisk") for name, _ in scr)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
