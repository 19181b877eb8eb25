"""The colocated seam's codec, used by both sides: round trips and golden bytes."""

from __future__ import annotations

import numpy as np
import pytest

from mtc.shared.colocated_codec import decode_reply, decode_request, encode_reply, encode_request
from mtc.shared.errors import ProtocolError, StepNotFoundError

pytestmark = pytest.mark.unit


def test_request_round_trip_and_padding():
    req = {"id": "abc", "op": "commit", "gen": 7, "step": 3}
    row = encode_request(req)
    assert row.dtype == np.uint8 and row.tobytes() == b'{"id": "abc", "op": "commit", "gen": 7, "step": 3}'
    padded = np.concatenate([row, np.zeros(9, np.uint8)])  # rows are padded to the widest
    assert decode_request(padded) == req
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode_request(np.frombuffer(b"{nope", np.uint8))


def test_reply_carries_results_and_typed_errors():
    assert decode_reply(encode_reply(lambda: ({"host": "h", "steps": [1]}, [b'{"m": 1}']))) == (
        {"host": "h", "steps": [1]}, [b'{"m": 1}'], None)

    def fails():
        raise StepNotFoundError("step 9 is not here")

    data = encode_reply(fails)
    assert data == b'{"error": "StepNotFoundError", "message": "step 9 is not here"}'
    assert decode_reply(data) == (None, [], ("StepNotFoundError", "step 9 is not here"))

    def bug():
        raise KeyError("x")

    # Every exception is reported with its type, naming the host (mtc.shared.wire_errors).
    assert decode_reply(encode_reply(bug, host="h3")) == (None, [], ("KeyError", "host h3: 'x'"))
    with pytest.raises(ProtocolError, match="neither"):
        decode_reply(b'{"other": 1}')


def test_a_host_id_inside_a_quoted_path_still_gets_the_host_named():
    """A short host id ("vm") turned up inside a temporary folder's random name, and the error lost
    its "host vm:" (a CI failure): only "host <id>" counts as naming the host."""
    from mtc.shared import wire_errors

    path_err = FileExistsError(17, "File exists", "/dev/shm/mtc-test-5vm4_09b/mtc/steps")
    assert wire_errors.encode(path_err, host="vm")[1].startswith("host vm: ")
    assert str(wire_errors.decode("vm", "FileExistsError", str(path_err))).startswith("FileExistsError: host vm: ")
    assert str(wire_errors.decode("vm", "MTCError", "host vm: gone")) == "host vm: gone"  # named once, not twice


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                 b'{"op": "verify", "step": ' + b"9" * 4000 + b"}", b'{"op": "verify", "step": NaN}',
                                 b'{"op": "backup_listing", "deadline_s": 1e400}',
                                 b'{"op": "backup_listing", "root": "/a\\udcff"}'])
def test_the_colocated_decoder_bounds_requests_as_the_daemon_does(raw):
    """Nesting, numbers and strings no parser behind it could hold: a ProtocolError, as a daemon's
    frame header gets (``protocol.loads_message``), never a RecursionError or a ValueError."""
    from mtc.shared import protocol

    with pytest.raises(ProtocolError):
        decode_request(np.frombuffer(raw, np.uint8))
    with pytest.raises(ProtocolError):
        protocol.loads_message(raw)


def test_a_reply_with_a_lone_surrogate_is_mended_not_refused():
    """An answer may quote a file name that is not UTF-8; the head gets it printable."""
    data = encode_reply(lambda: ({"path": "/r/a\udcff"}, []))
    assert decode_reply(data)[0] == {"path": "/r/a\ufffd"}


def test_payloads_travel_raw_after_the_json_in_both_directions():
    """A manifest rides as bytes after its message's JSON and a newline, never as a JSON string: bytes
    of any value (newlines, NULs), a ``Gathered`` one as its buffers back to back, in a padded row."""
    from mtc.shared.protocol import Gathered

    manifest = Gathered((b'{"header": 1}', b"\n", bytes(range(256)) * 3, b"\n", b"\0\0tail\0"))
    payloads = (b"a\nb\0", manifest, b"")
    row = encode_request({"id": "x", "op": "commit", "step": 4}, payloads)
    assert b'"payload_bytes"' in row.tobytes() and bytes(range(256)) in row.tobytes()
    padded = np.concatenate([row, np.zeros(100, np.uint8)])
    assert decode_request(padded) == {"id": "x", "op": "commit", "step": 4,
                                      "payloads": [b"a\nb\0", manifest.join(), b""]}
    reply = encode_reply(lambda: ({"host": "h"}, [manifest.join(), b"\n"]))
    assert decode_reply(reply + bytes(7)) == ({"host": "h"}, [manifest.join(), b"\n"], None)
    assert decode_reply(encode_reply(lambda: ({"host": "h"}, []))) == ({"host": "h"}, [], None)


@pytest.mark.parametrize("sizes", ["[5]", "[-1]", "5", '["3"]', "[1, 2, 3]"])
def test_payload_sizes_that_the_row_does_not_hold_are_refused(sizes):
    raw = b'{"id": "x", "op": "commit", "payload_bytes": ' + sizes.encode() + b'}\nabcd'
    with pytest.raises(ProtocolError, match="'payload_bytes' must list the sizes"):
        decode_request(np.frombuffer(raw, np.uint8))
