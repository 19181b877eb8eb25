"""The soak's packet loss and latency, on real network namespaces: what ``net_loss`` and ``net_latency``
inject is what they say (a share of the packets dropped; each chunk held D ms each way, on connections
opened before the delay too, the bytes unchanged), before the soak relies on them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

import soak

pytestmark = pytest.mark.chaos

ECHO = """
import socket, sys, threading
kind, port = sys.argv[1], int(sys.argv[2])
if kind == "udp":  # count datagrams; answer "count" with how many came so far
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    print("ready", flush=True)
    n = 0
    while True:
        d, a = s.recvfrom(2048)
        if d == b"count":
            try:
                s.sendto(str(n).encode(), a)
            except PermissionError:  # a packet dropped on its way out: the sender asks again
                pass
        else:
            n += 1
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen()
print("ready", flush=True)

def echo(c):
    while d := c.recv(1 << 16):
        c.sendall(d)
    c.close()

while True:
    c, _ = s.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
"""


def _needs_root_and_nft() -> None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2: the hosts are network namespaces")
    if not shutil.which("nft"):
        pytest.skip("needs nftables (the nft command: apt-get install nftables): loss and the relay's redirect")


@pytest.fixture
def net():
    _needs_root_and_nft()
    n = soak.HostNetwork(None, ["a", "b"])
    servers: list[subprocess.Popen] = []

    def serve(kind: str, port: int) -> str:
        """An echo (tcp) or counting (udp) server on host b; its address."""
        ns, _, addr = n.hosts["b"]
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", ECHO, kind, str(port)],
                             stdout=subprocess.PIPE)
        servers.append(p)
        assert p.stdout.readline() == b"ready\n"
        return addr

    try:
        n.start()
        n.start_relays()
        n.serve = serve
        yield n
    finally:
        for p in servers:
            p.kill()
            p.wait()
            p.stdout.close()
        n.close()
    assert not [x for x in soak.leftover_netns() if x.startswith(f"mtc-soak-{n.tag}-")]
    n.release()


def _round_trip(sock: socket.socket, data: bytes) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    sender = threading.Thread(target=sock.sendall, args=(data,))
    sender.start()
    got = bytearray()
    while len(got) < len(data):
        chunk = sock.recv(1 << 20)
        assert chunk, "the echo connection closed early"
        got += chunk
    sender.join()
    return time.perf_counter() - t0, bytes(got)


def test_the_relay_holds_each_chunk_both_ways_on_open_connections_and_keeps_the_bytes(net):
    addr = net.serve("tcp", 5000)
    opened_before = socket.create_connection((addr, 5000), timeout=30)
    took, _ = _round_trip(opened_before, b"x")
    assert took < 0.1, took  # no delay yet
    net.delay("b", 150)
    took, got = _round_trip(opened_before, b"y")
    assert got == b"y" and 0.3 <= took < 1.5, took  # 150 ms each way, on a connection made before
    data = os.urandom(8 << 20)
    with socket.create_connection((addr, 5000), timeout=30) as fresh:
        took, got = _round_trip(fresh, data)
    assert got == data, "the relay changed the bytes"
    assert 0.3 <= took < 15, took  # 8 MiB in flight, not 8 MiB a round trip
    net.delay("b", 0)
    took, got = _round_trip(opened_before, b"z")
    assert got == b"z" and took < 0.3, took
    opened_before.close()


def test_a_refused_connection_through_the_relay_is_a_reset(net):
    addr = net.hosts["b"][2]
    with pytest.raises(ConnectionResetError):  # on connecting, or on the first read
        with socket.create_connection((addr, 5001), timeout=10) as s:  # nothing listens there
            s.sendall(b"x")
            if not s.recv(1):
                raise AssertionError("an orderly close, not a reset")


def test_loss_drops_about_the_share_asked_and_ends_when_lifted(net):
    addr = net.serve("udp", 5002)

    def count(s: socket.socket) -> int:
        for _ in range(20):  # the question and its answer are dropped too, at times
            s.sendto(b"count", (addr, 5002))
            try:
                return int(s.recvfrom(64)[0])
            except TimeoutError:
                continue
        raise AssertionError("no count came back")

    def delivered(n: int = 2000) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(1)
            before = count(s)
            for _ in range(n):
                s.sendto(b"d" * 64, (addr, 5002))
                time.sleep(0.0002)
            time.sleep(0.2)
            return count(s) - before

    assert delivered() == 2000
    net.lose("b", 30)
    got = delivered()
    assert 0.6 * 2000 <= got <= 0.8 * 2000, got  # 30 % dropped, give or take
    net.unlose("b")
    net.unlose("b")  # lifting it twice is no error
    assert delivered() == 2000
