"""The head lease a sidecar keeps on its ramdisk (values, no processes)."""

from __future__ import annotations

import pytest

from mtc.shared.errors import FencedError, ProtocolError
from mtc.sidecar.fencing import HeadLease

pytestmark = pytest.mark.unit

A = {"host": "h1", "pid": 11, "started": "2026-12-01T00:00:00Z", "id": "a"}
B = {"host": "h2", "pid": 22, "started": "2026-12-01T01:00:00Z", "id": "b"}


def test_newer_claim_takes_over_and_older_requests_are_refused(tmp_path):
    lease = HeadLease(tmp_path)
    assert lease.current() is None
    lease.check(None, "write")  # never claimed: a tool driving the sidecar by hand
    lease.claim(10, A)
    lease.check(10, "write")
    lease.claim(20, B)
    with pytest.raises(FencedError, match=r"generation 10\) was fenced off by the head pid 22 on h2, started "
                                          r"2026-12-01T01:00:00Z \(generation 20\)"):
        lease.check(10, "write")
    with pytest.raises(FencedError, match="carries no head generation.*pid 22"):
        lease.check(None, "commit")
    with pytest.raises(FencedError, match="holds generation 20"):
        lease.claim(15, A)
    assert lease.claim(20, B)["generation"] == 20  # the same head asking again
    assert HeadLease(tmp_path).current() == {"generation": 20, "head": B}  # on disk, for every process


def test_a_wiped_lease_adopts_the_next_generation(tmp_path):
    lease = HeadLease(tmp_path)
    lease.claim(5, A)
    (tmp_path / "head.json").unlink()
    lease.check(7, "write")
    assert lease.current()["generation"] == 7
    with pytest.raises(FencedError):
        lease.check(5, "write")
    (tmp_path / "head.json").write_text("not json")
    lease.check(3, "write")  # unreadable: treated as unclaimed (logged)


@pytest.mark.parametrize("bad", [0, -1, "5", 1.5, True])
def test_malformed_generations_are_protocol_errors(tmp_path, bad):
    with pytest.raises(ProtocolError, match="generation"):
        HeadLease(tmp_path).check(bad, "write")


def test_a_lease_replaced_by_another_process_is_seen_at_once(tmp_path):
    """Each sidecar process of a host keeps its last read of the lease and trusts it while the file
    is unchanged (one stat): a claim through another process's object must still fence it off."""
    mine, other = HeadLease(tmp_path), HeadLease(tmp_path)
    mine.claim(10, A)
    for _ in range(3):
        mine.check(10, "write")  # read once, then kept
    other.claim(11, B)  # right after: the same second, the same size of file
    with pytest.raises(FencedError, match="generation 11"):
        mine.check(10, "write")
    got = mine.current()
    got["head"]["pid"] = 0  # a caller's copy: the lease kept is not changed through it
    assert mine.current() == {"generation": 11, "head": B}
