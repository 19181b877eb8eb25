"""The inventory snapshot the step choice and the restore plan share (a value, no processes)."""

from __future__ import annotations

import pytest

from mtc.head.dispatch.interface import HostInventory
from mtc.head.reports import Inventory
from mtc.head.replication.plan import step_views
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.unit


def _inv(host: str, steps: dict[int, list[str]], have: set[str]) -> HostInventory:
    from mtc.sidecar.replication import held_bits

    return HostInventory.from_wire(host, {"host": host, "steps": [
        {"step": s, "blobs": len(b), "local_blobs": len(set(b) & have), **held_bits(set(b), have)}
        for s, b in steps.items()]})


def test_restorable_steps_and_what_an_error_adds():
    a, b = blob_name(b"a"), blob_name(b"b")
    inventories = {"h0": _inv("h0", {1: [a, b], 2: [a, b]}, {a, b}), "h1": _inv("h1", {1: [a, b]}, {a})}
    inv = Inventory(views=step_views(inventories), unreachable={})
    assert inv.restorable == [1, 2] and inv.note() == ""
    down = Inventory(views=step_views({"h0": inventories["h0"]}), unreachable={"h1": "connection refused"},
                     backup_unreachable="503 from the bucket")
    assert down.restorable == []  # no step is confirmed while a host cannot be asked
    assert "h1 (connection refused)" in down.note() and "503 from the bucket" in down.note()
    with pytest.raises(Exception):
        inv.views = {}  # frozen
