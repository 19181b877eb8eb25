"""The head's and a sidecar's ``/metrics`` against slow or idle clients, over real sockets and real servers:
200 idle connections hold a bounded number of threads in the head's process while a real scrape is served
within the request deadline, and clients that trickle a byte every 3 s (under any per-read timeout) hold a
scrape slot no longer than that deadline, so a real scrape gets in. The head binds ``metrics_address``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from mtc.head import metrics
from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.integration

LIMIT = 8  # scrapes served at once, on either endpoint
DEADLINE_S = 5.0  # from a connection's accept to the end of its request headers
MARGIN_S = 3.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 10, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        return r.read().decode()


def scrape_until(port: int, by: float, expect: str) -> float:
    """Scrape until one is served (a busy server closes or answers 503 meanwhile); when it was served."""
    while True:
        try:
            assert expect in scrape(port, timeout=max(0.5, by - time.monotonic()))
            return time.monotonic()
        except OSError as e:
            assert time.monotonic() < by, f"no scrape served in time: {e!r}"
            time.sleep(0.1)


def open_many(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:  # the backlog overflowed: the server bounds what it holds, that is the point
            continue
    return socks


class SlowSenders:
    """``n`` connections, each sent one byte of a request every ``every`` seconds (never all of it)."""

    REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: slow-loris\r\nAccept: */*\r\n\r\n"

    def __init__(self, port: int, n: int, every: float = 3.0):
        self.socks = open_many(port, n)
        self._every, self._stop = every, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set() and i < len(self.REQUEST) - 4:
            for s in self.socks:
                try:
                    s.sendall(self.REQUEST[i:i + 1])
                except OSError:  # closed by the server: it stays closed (no reconnecting)
                    pass
            i += 1
            self._stop.wait(self._every)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self.socks:
            s.close()


def head_port() -> int:
    """The head's /metrics of this process (one per process: a server another test started is reused)."""
    return metrics.serve(metrics.served_port() or free_port())


@pytest.fixture
def sidecar_port(ramdisk):
    from mtc.sidecar.metrics import serve_metrics
    from mtc.sidecar.service import SidecarService

    svc = SidecarService(ramdisk / "h" / "mtc", host_id="s0-h0")
    server = serve_metrics(0, svc, addr="127.0.0.1")
    try:
        yield server
    finally:
        server.close()
        svc.close()


def test_the_heads_endpoint_holds_200_idle_connections_on_a_bounded_number_of_threads():
    port = head_port()
    assert "mtc_saves_total" in scrape(port)
    base = threading.active_count()
    t0 = time.monotonic()
    socks = open_many(port, 200)
    try:
        assert len(socks) >= 100
        time.sleep(1.0)
        held = threading.active_count()
        assert held < base + LIMIT + 5, f"{len(socks)} idle connections hold {held - base} more threads"
        # The idle ones are dropped at the deadline: a real scrape is served by then, the flood still open.
        served = scrape_until(port, t0 + DEADLINE_S + MARGIN_S, "mtc_saves_total")
        assert served - t0 < DEADLINE_S + MARGIN_S
        assert threading.active_count() < base + LIMIT + 5
    finally:
        for s in socks:
            s.close()
    assert "mtc_saves_total" in scrape(port)


def test_slow_senders_do_not_lock_the_heads_scrapes_out_past_the_deadline():
    port = head_port()
    t0 = time.monotonic()
    slow = SlowSenders(port, LIMIT + 2)
    try:
        served = scrape_until(port, t0 + DEADLINE_S + MARGIN_S, "mtc_saves_total")
        assert served - t0 < DEADLINE_S + MARGIN_S
    finally:
        slow.close()


def test_slow_senders_do_not_lock_a_sidecars_scrapes_out_past_the_deadline(sidecar_port):
    server = sidecar_port
    assert "mtc_sidecar_committed_steps" in scrape(server.port)
    t0 = time.monotonic()
    slow = SlowSenders(server.port, LIMIT + 2)
    try:
        time.sleep(0.5)
        refused = server.refused
        assert refused >= 2  # the ones past the limit were closed at once, and counted
        served = scrape_until(server.port, t0 + DEADLINE_S + MARGIN_S, 'mtc_sidecar_committed_steps{host="s0-h0"} 0.0')
        assert served - t0 < DEADLINE_S + MARGIN_S
    finally:
        slow.close()


def test_a_slow_sender_is_dropped_at_the_deadline_however_it_trickles(sidecar_port):
    """The deadline counts from the accept, not from the last byte: a byte every 0.5 s still ends at 5 s."""
    s = socket.create_connection(("127.0.0.1", sidecar_port.port), timeout=10)
    t0 = time.monotonic()
    try:
        closed_at = None
        for b in SlowSenders.REQUEST[:-4]:
            try:
                s.sendall(bytes([b]))
                s.settimeout(0.5)
                if s.recv(1024) == b"":
                    closed_at = time.monotonic()
                    break
            except socket.timeout:
                continue
            except OSError:
                closed_at = time.monotonic()
                break
        assert closed_at is not None, "a trickling client was never dropped"
        assert DEADLINE_S - 0.5 <= closed_at - t0 < DEADLINE_S + 1.5
    finally:
        s.close()


def test_oversized_headers_and_other_paths_are_answered_and_closed(sidecar_port):
    port = sidecar_port.port
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
    assert e.value.code == 404
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        except OSError:
            pass  # closed before all of it was sent: refused, as it should be
        try:
            answer = s.recv(1024)
        except OSError:
            answer = b""
        assert not answer.startswith(b"HTTP/1.1 200")


def test_the_head_negotiates_openmetrics_and_gzip_as_prometheus_asks():
    import gzip

    port = head_port()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert r.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(r.read()).decode()
    assert "mtc_saves_total" in text and text.rstrip().endswith("# EOF")


def test_metrics_address_is_a_setting_with_its_variable():
    assert MTCConfig(local_checkpoint_directory="/tmp/x").metrics_address == "0.0.0.0"
    env = {"MTC_METRICS_PORT": "9400", "MTC_METRICS_ADDRESS": "127.0.0.1"}
    cfg = MTCConfig.from_flags(["local_checkpoint_directory=/tmp/x"], environ=env)
    assert (cfg.metrics_port, cfg.metrics_address) == (9400, "127.0.0.1")
    with pytest.raises(ConfigError, match="metrics_address"):
        MTCConfig(local_checkpoint_directory="/tmp/x", metrics_address=" ")


def test_the_head_binds_metrics_address(tmp_path):
    """A manager's metrics (attach) on MTC_METRICS_ADDRESS=127.0.0.2: served there, not on 127.0.0.1."""
    port = free_port("127.0.0.2")
    code = textwrap.dedent(f"""
        import sys, time, types, urllib.request
        from mtc.head import metrics
        from mtc.shared.config import MTCConfig
        cfg = MTCConfig.from_flags(["local_checkpoint_directory=/tmp/x"])
        assert cfg.metrics_address == "127.0.0.2", cfg.metrics_address
        hooks = types.SimpleNamespace(listeners=[], inventory_listeners=[], scrub=types.SimpleNamespace(listeners=[]))
        metrics.attach(cfg, hooks, types.SimpleNamespace(listeners=[], scrub=hooks.scrub, running=False))
        with urllib.request.urlopen("http://127.0.0.2:{port}/metrics", timeout=10) as r:
            assert b"mtc_saves_total" in r.read()
        try:
            urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=5)
        except OSError as e:
            print("refused on 127.0.0.1:", e)
        else:
            sys.exit("served on 127.0.0.1 too")
    """)
    env = {**os.environ, "MTC_METRICS_PORT": str(port), "MTC_METRICS_ADDRESS": "127.0.0.2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused on 127.0.0.1" in out.stdout
