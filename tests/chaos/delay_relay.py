"""A delaying TCP relay: added latency on one host's link, where the kernel has no ``netem``.

    ip netns exec NS python delay_relay.py PORT MARK      (stdin: one-way delay in ms, one number a line)

Run inside a host's network namespace, with ``nft_rules(PORT, MARK)`` loaded there, it carries every
TCP connection into and out of the namespace: an incoming connection (on any port) is redirected to
the relay, which opens its own connection to where the client was going (``SO_ORIGINAL_DST``); an
outgoing one likewise, the relay's own connections marked ``MARK`` so the rules let them pass. Each
chunk read on one side is written to the other ``delay`` ms later, in order, both ways: a request
and its answer each wait ``delay``, while a stream keeps its throughput (chunks in flight, up to a
bound). A connection closed on one side is half-closed on the other; one reset, or a target that
refuses, is a reset on the other (``SO_LINGER`` 0), so a client sees what it would see without the
relay, less the refusal itself (its own connection was accepted first).

It prints ``ready`` once it listens. Each line on stdin sets the delay for the chunks read from then
on (``0``: none; chunks already waiting keep their time, so the order holds); end of stdin stops it.
Connections made before the rules were loaded do not pass through it: load them before the
namespace's processes connect (``HostNetwork.start``).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CHUNK = 64 << 10
IN_FLIGHT = 64  # chunks queued per direction before the reader waits (4 MiB)
CONNECT_TIMEOUT_S = 10.0


def nft_rules(port: int, mark: int, dev: str = "eth0", table: str = "mtc_delay") -> str:
    """The ``nft -f`` script that sends every TCP connection through ``dev`` to the relay on ``port``."""
    return (f"table ip {table} {{\n"
            f"  chain pre {{ type nat hook prerouting priority dstnat; policy accept;\n"
            f"    iifname \"{dev}\" meta l4proto tcp redirect to :{port}; }}\n"
            f"  chain out {{ type nat hook output priority -100; policy accept;\n"
            f"    meta mark {mark} return; oifname \"{dev}\" meta l4proto tcp redirect to :{port}; }}\n"
            f"}}\n")


class Relay:
    def __init__(self, port: int, mark: int):
        self.port, self.mark = port, mark
        self.delay_s = 0.0
        self.conns: set[asyncio.Task] = set()

    async def serve(self) -> None:
        server = await asyncio.start_server(self._accepted, "0.0.0.0", self.port, limit=CHUNK)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        loop = asyncio.get_running_loop()
        stdin = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        try:
            while line := await stdin.readline():
                self.delay_s = max(0.0, float(line) / 1000)
        finally:
            server.close()
            for t in list(self.conns):
                t.cancel()

    async def _accepted(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.conns.add(task)
        try:
            await self._carry(r, w)
        finally:
            self.conns.discard(task)

    async def _carry(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        raw = w.get_extra_info("socket").getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, ip = struct.unpack("!2xH4s8x", raw)
        target = (socket.inet_ntoa(ip), port)
        if port == self.port:  # not redirected: a connection to the relay itself
            _reset(w)
            return
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
        s.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, target), CONNECT_TIMEOUT_S)
            r2, w2 = await asyncio.open_connection(sock=s, limit=CHUNK)
        except (OSError, asyncio.TimeoutError):
            s.close()
            _reset(w)
            return
        q1, q2 = asyncio.Queue(IN_FLIGHT), asyncio.Queue(IN_FLIGHT)
        parts = [asyncio.create_task(c) for c in (self._read(r, q1), self._write(q1, w2),
                                                 self._read(r2, q2), self._write(q2, w))]
        try:
            done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() for t in done):
                _reset(w)
                _reset(w2)
        finally:
            for t in parts:
                t.cancel()
            for x in (w, w2):
                if not x.is_closing():
                    x.close()

    async def _read(self, src: asyncio.StreamReader, q: asyncio.Queue) -> None:
        """Chunks of ``src`` into ``q``, each with the time it is due (``delay`` after it was read)."""
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            chunk = await src.read(CHUNK)
            last = max(last, loop.time() + self.delay_s)  # a shorter delay never overtakes a longer one
            await q.put((last, chunk))
            if not chunk:
                return

    @staticmethod
    async def _write(q: asyncio.Queue, dst: asyncio.StreamWriter) -> None:
        """``q``'s chunks to ``dst``, each when it is due; the end of its source half-closes ``dst``."""
        loop = asyncio.get_running_loop()
        while True:
            due, chunk = await q.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not chunk:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            dst.write(chunk)
            await dst.drain()


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with a reset, as the kernel answers a connection whose other end is gone."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    w.transport.abort()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        sys.stderr.write("usage: delay_relay.py PORT MARK\n")
        return 2
    asyncio.run(Relay(int(argv[0]), int(argv[1])).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
