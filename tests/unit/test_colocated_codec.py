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
    with pytest.raises(ProtocolError, match="not JSON"):
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
