"""A sidecar daemon's ``/metrics`` (clear text) against a local attacker: bound where its control
port is bound unless ``--metrics-host`` says otherwise, and a flood of half-open scrapes holds a
bounded number of threads, after which the metrics are served again. Real daemon processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TOKEN = "metrics-bounds-test-token-0123456789"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Daemon:
    def __init__(self, root: Path, tmp: Path, *args: str):
        self.ready, self.log = tmp / "ready.json", tmp / "d0.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "mtc.sidecar", "serve", "--root", str(root),
                                      "--host-id", "s0-h0", "--ready-file", str(self.ready),
                                      "--log-file", str(self.log), *args], env={**os.environ, "MTC_PEER_TOKEN": TOKEN})
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.address = json.loads(self.ready.read_text())["address"]

    def threads(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        raise AssertionError("no Threads line")

    def close(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(timeout=60) == 0


def _scrape(host: str, port: int, timeout: float = 10) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        return r.read().decode()


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return False
    except ConnectionRefusedError:
        return True


def test_metrics_bind_where_the_control_port_binds(ramdisk, tmp_path):
    port = _free_port("127.0.0.2")
    d = _Daemon(ramdisk / "d0", tmp_path, "--listen", "127.0.0.2:0", "--peer-listen", "127.0.0.2:0",
                "--metrics-port", str(port))
    try:
        assert d.address.startswith("127.0.0.2:")
        assert 'mtc_sidecar_committed_steps{host="s0-h0"} 0.0' in _scrape("127.0.0.2", port)
        assert _refused("127.0.0.1", port), "the metrics listen on another address than the control port"
    finally:
        d.close()


def test_metrics_host_binds_the_metrics_elsewhere_on_purpose(ramdisk, tmp_path):
    port = _free_port("127.0.0.1")
    d = _Daemon(ramdisk / "d0", tmp_path, "--listen", "127.0.0.2:0", "--peer-listen", "127.0.0.2:0",
                "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    try:
        assert "mtc_sidecar_ramdisk_free_bytes" in _scrape("127.0.0.1", port)
        assert _refused("127.0.0.2", port)
    finally:
        d.close()


def test_half_open_scrapes_hold_a_bounded_number_of_threads(ramdisk, tmp_path):
    port = _free_port("127.0.0.1")
    d = _Daemon(ramdisk / "d0", tmp_path, "--metrics-port", str(port))
    socks = []
    try:
        _scrape("127.0.0.1", port)
        before = d.threads()
        for i in range(300):  # every other one sends half a request; none finishes it
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        time.sleep(1.0)
        grown = d.threads() - before
        assert grown <= 16, f"{len(socks)} half-open scrapes hold {grown} more threads"
    finally:
        for s in socks:
            s.close()
    try:
        deadline = time.monotonic() + 30  # served again once the flood is gone
        while True:
            try:
                assert "mtc_sidecar_jobs_running" in _scrape("127.0.0.1", port, timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the metrics are not served after the flood"
                time.sleep(0.2)
        assert d.proc.poll() is None and "Traceback" not in d.log.read_text()
    finally:
        d.close()
