"""A sidecar daemon's close(): it refuses new requests, lets those in flight finish, then stops."""

from __future__ import annotations

import threading

import pytest

from helpers import control_connection
from mtc.shared import protocol
from mtc.shared.errors import ProtocolError
from mtc.sidecar.daemon import SidecarDaemon
from mtc.sidecar.service import SidecarService
from mtc.sidecar.tcpserver import ServerStopping

TOKEN = "shutdown-test-token-0123456789"


def test_close_refuses_new_requests_and_waits_for_those_in_flight(tmp_path):
    svc = SidecarService(tmp_path / "ram", host_id="h0", awaits_head=True)
    entered, release = threading.Event(), threading.Event()
    answer = svc.fingerprint

    def slow_fingerprint():
        entered.set()
        assert release.wait(30)
        return answer()

    svc.fingerprint = slow_fingerprint
    daemon = SidecarDaemon(svc, TOKEN)
    daemon.start()
    busy, idle = control_connection(daemon.address, TOKEN), control_connection(daemon.address, TOKEN)
    closer = threading.Thread(target=daemon.close)
    try:
        protocol.send_request(busy, protocol.Request("fingerprint", 3, {}))
        assert entered.wait(30)
        closer.start()
        for _ in range(3000):  # close() has begun once admit() refuses
            try:
                with daemon.admit():
                    pass
            except ServerStopping:
                break
            threading.Event().wait(0.01)
        else:
            pytest.fail("close() did not start refusing requests")

        # A new request is not served: it is answered "shutting down", or its idle connection was
        # already closed by the shutdown (which of the two depends on where the server's thread is).
        try:
            protocol.send_request(idle, protocol.Request("ping", 3, {}))
            refused = protocol.recv_reply(idle)
        except (OSError, ProtocolError):
            pass
        else:
            assert refused.error is not None and refused.error.type == "HostUnreachableError"
            assert "shutting down" in refused.error.message
        assert closer.is_alive(), "close() must wait for the request in flight"

        release.set()
        done = protocol.recv_reply(busy)
        assert done.error is None and done.result["host"] == "h0"
        closer.join(30)
        assert not closer.is_alive()
    finally:
        release.set()
        busy.close()
        idle.close()
        if closer.is_alive():
            closer.join(30)
        daemon.close()
