"""The peer tier's plan (mtc.head.replication.plan): where copies go, restore pulls, inventory views."""

from __future__ import annotations

from collections import Counter

import pytest

from mtc.head.replication.plan import ReplicationStrategy, Transfer, step_views, summarize
from mtc.head.dispatch.interface import HostInventory, PullResult
from mtc.shared import protocol
from mtc.shared.errors import ProtocolError

pytestmark = pytest.mark.unit


def blob(i: int) -> str:
    return f"{i:032x}"


def topo(slices: int, hosts: int) -> dict[str, int]:
    return {f"s{s}-h{h}": s for s in range(slices) for h in range(hosts)}


def check_plan(strategy, sizes, holders, topology, plan, targets=None):
    """Every transfer copies from a holder to an eligible host that lacks it; afterwards each blob
    with a holder has min(factor, domains) copies on distinct domains."""
    after = {b: set(holders.get(b, ())) for b in sizes}
    for t in plan:
        assert t.src in after[t.blob], t
        assert t.dst not in after[t.blob], t
        assert t.nbytes == sizes[t.blob]
        if targets is not None:
            assert t.dst in targets
        after[t.blob].add(t.dst)
    for b in sizes:
        if after[b] and targets is None:
            assert strategy.copies(after[b], topology) == min(strategy.factor, strategy.domains(topology)), b
    return after


def test_data_parallel_twins_already_count_so_two_slices_plan_nothing():
    t = topo(2, 4)
    # Host h of slice 0 and host h of slice 1 hold the same shards (data-parallel twins).
    holders = {blob(10 * h + k): {f"s0-h{h}", f"s1-h{h}"} for h in range(4) for k in range(3)}
    sizes = {b: 1000 + i for i, b in enumerate(holders)}
    s = ReplicationStrategy(2)
    assert s.plan(sizes, holders, t) == []
    assert s.shortfall(sizes, holders, t) == {}


def test_one_slice_copies_each_blob_once_to_another_host_with_even_load():
    t = topo(1, 4)
    holders = {blob(10 * h + k): {f"s0-h{h}"} for h in range(4) for k in range(4)}
    sizes = {b: 1 << 20 for b in holders}
    s = ReplicationStrategy(2)
    plan = s.plan(sizes, holders, t)
    assert len(plan) == len(holders)  # one copy each: two hosts hold each blob
    check_plan(s, sizes, holders, t, plan)
    incoming = Counter(tr.dst for tr in plan)
    outgoing = Counter(tr.src for tr in plan)
    assert set(incoming.values()) == {4} and set(outgoing.values()) == {4}  # spread evenly
    assert all(isinstance(tr, Transfer) and tr.src != tr.dst for tr in plan)


def test_first_copy_goes_to_the_ring_neighbour():
    t = topo(1, 4)
    s = ReplicationStrategy(2)
    for h in range(4):
        (tr,) = s.plan({blob(1): 5}, {blob(1): {f"s0-h{h}"}}, t)
        assert (tr.src, tr.dst) == (f"s0-h{h}", f"s0-h{(h + 1) % 4}")


def test_two_slices_copy_unique_shards_to_the_other_slice_spread_over_its_hosts():
    t = topo(2, 2)
    # Shards split over "data" too: each host holds blobs nobody else has.
    holders = {blob(10 * i + k): {h} for i, h in enumerate(t) for k in range(4)}
    sizes = {b: 4096 for b in holders}
    s = ReplicationStrategy(2)
    plan = s.plan(sizes, holders, t)
    check_plan(s, sizes, holders, t, plan)
    assert len(plan) == len(holders)
    assert all(t[tr.src] != t[tr.dst] for tr in plan)  # distinct slices, not just hosts
    assert set(Counter(tr.dst for tr in plan).values()) == {4}


def test_more_copies_than_domains_fill_every_domain_and_report_the_shortfall():
    t = topo(2, 2)
    holders = {blob(1): {"s0-h0"}}
    s = ReplicationStrategy(3)
    plan = s.plan({blob(1): 8}, holders, t)
    assert len(plan) == 1 and t[plan[0].dst] == 1
    after = {blob(1): {"s0-h0", plan[0].dst}}
    assert s.shortfall({blob(1): 8}, after, t) == {blob(1): 1}


def test_three_copies_on_one_slice_go_to_two_distinct_hosts():
    t = topo(1, 4)
    s = ReplicationStrategy(3)
    plan = s.plan({blob(1): 8, blob(2): 8}, {blob(1): {"s0-h0"}, blob(2): {"s0-h0", "s0-h2"}}, t)
    per_blob = Counter(tr.blob for tr in plan)
    assert per_blob == {blob(1): 2, blob(2): 1}
    assert len({tr.dst for tr in plan if tr.blob == blob(1)}) == 2


def test_down_hosts_are_never_destinations_and_lost_blobs_are_reported_not_planned():
    t = topo(1, 3)
    holders = {blob(1): {"s0-h0"}, blob(2): {"s0-h1"}, blob(3): set(), blob(4): {"elsewhere"}}
    sizes = {b: 10 for b in holders}
    s = ReplicationStrategy(2)
    plan = s.plan(sizes, holders, t, targets={"s0-h0", "s0-h1"})
    check_plan(s, sizes, holders, t, plan, targets={"s0-h0", "s0-h1"})
    assert {(tr.blob, tr.dst) for tr in plan} == {(blob(1), "s0-h1"), (blob(2), "s0-h0")}
    assert s.shortfall(sizes, holders, t) == {blob(1): 1, blob(2): 1, blob(3): 2, blob(4): 2}


def test_existing_copies_count_and_largest_blobs_are_placed_first():
    t = topo(1, 3)
    s = ReplicationStrategy(2)
    holders = {blob(1): {"s0-h0", "s0-h2"}, blob(2): {"s0-h0"}, blob(3): {"s0-h0"}}
    plan = s.plan({blob(1): 1, blob(2): 100, blob(3): 50}, holders, t)
    assert [tr.blob for tr in plan] == [blob(2), blob(3)]
    assert {tr.dst for tr in plan} == {"s0-h1", "s0-h2"}  # the second goes to the less loaded host


def test_plan_accepts_a_step_manifest():
    from mtc.shared import format as fmt

    rec = fmt.ArrayRecord(key="x", kind="jax", dtype="float32", shape=(4,), shards=(
        fmt.ShardRecord(((0, 2),), blob(1), 8, (0,)), fmt.ShardRecord(((2, 4),), blob(2), 8, (1,))))
    m = fmt.StepManifest(step=3, arrays=(rec,), tree=None)
    plan = ReplicationStrategy(2).plan(m, {blob(1): {"s0-h0"}, blob(2): {"s0-h1"}}, topo(1, 2))
    assert sorted((tr.blob, tr.src, tr.dst) for tr in plan) == [(blob(1), "s0-h0", "s0-h1"), (blob(2), "s0-h1", "s0-h0")]


def test_restore_pulls_spread_over_holders_with_fallbacks():
    holders = {blob(i): {"s0-h1", "s0-h2", "s0-h0"} for i in range(6)}
    holders[blob(9)] = {"s0-h0"}  # no other host holds it: an empty list of holders
    sizes = {b: 100 for b in holders}
    pulls = ReplicationStrategy.pulls({"s0-h0": list(holders)}, holders, sizes)
    rows = pulls["s0-h0"]
    first = Counter(srcs[0] for b, _, srcs in rows if srcs)
    assert first == {"s0-h1": 3, "s0-h2": 3}
    for b, n, srcs in rows:
        assert "s0-h0" not in srcs and n == 100
        assert sorted(srcs) == ([] if b == blob(9) else ["s0-h1", "s0-h2"])


def test_restore_pulls_for_several_hosts_share_the_load():
    holders = {blob(1): {"a", "b"}, blob(2): {"a", "b"}}
    sizes = {blob(1): 10, blob(2): 10}
    pulls = ReplicationStrategy.pulls({"c": [blob(1), blob(2)], "d": [blob(1), blob(2)]}, holders, sizes)
    load = Counter()
    for rows in pulls.values():
        for b, n, srcs in rows:
            load[srcs[0]] += n
    assert load == {"a": 20, "b": 20}
    assert ReplicationStrategy.pulls({"c": []}, holders, sizes) == {}


def test_strategy_refuses_a_bad_factor():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="replication factor"):
            ReplicationStrategy(bad)


# --- inventories -----------------------------------------------------------------------------------


def inv_step(step: int, names: list[str], have: set[str], own: set[str] | None = None) -> dict:
    own = set(names) if own is None else own
    return {"step": step, "blobs": len(own), "local_blobs": len(own & have), "step_blobs": len(names),
            "digest": protocol.blob_list_digest(names), "held": protocol.encode_bitmap([n in have for n in names])}


def test_bitmaps_round_trip_and_refuse_garbage():
    for bits in ([], [True], [False, True, True], [True] * 4, [i % 3 == 0 for i in range(37)]):
        assert protocol.decode_bitmap(protocol.encode_bitmap(bits), len(bits)) == bits
    assert protocol.encode_bitmap([True, False, False, False, True]) == "88"
    for text, n in (("8", 5), ("zz", 5), ("888", 5), (None, 1), ("8A", 5)):
        with pytest.raises(ProtocolError, match="bitmap"):
            protocol.decode_bitmap(text, n)


def test_step_views_say_who_holds_what_and_whether_a_step_is_restorable():
    names = sorted([blob(3), blob(1), blob(2)])
    inv = {
        "a": HostInventory.from_wire("a", {"steps": [inv_step(5, names, {blob(1)}, {blob(1)}),
                                                     inv_step(6, names, {blob(1)})]}),
        "b": HostInventory.from_wire("b", {"steps": [inv_step(5, names, {blob(2), blob(3)}, {blob(2)})]}),
        "c": HostInventory.unreachable("c", "connection refused"),
    }
    views = step_views(inv)
    assert views[5].restorable and not views[6].restorable
    assert views[5].by_name(names) == {blob(1): {"a"}, blob(2): {"b"}, blob(3): {"b"}}
    assert views[5].hosts == ("a", "b") and views[5].whole == ("a", "b") and views[6].whole == ()
    assert views[5].by_name([blob(1), blob(2)]) is None  # not this step's blob list
    t = {"a": 0, "b": 0, "c": 0}
    assert summarize(views[5], ReplicationStrategy(2), t) == {"restorable": True, "replicated": False, "min_copies": 1}


def test_step_views_keep_the_blob_list_most_hosts_agree_on():
    names = [blob(1), blob(2)]
    other = [blob(1), blob(7)]
    wire = {"a": {"steps": [inv_step(1, names, set(names))]}, "b": {"steps": [inv_step(1, names, {blob(2)})]},
            "c": {"steps": [inv_step(1, other, set(other))]}}
    v = step_views({h: HostInventory.from_wire(h, doc) for h, doc in wire.items()})[1]
    assert v.hosts == ("a", "b") and v.by_name(names) == {blob(1): {"a"}, blob(2): {"a", "b"}}


def test_an_inventory_without_bitmaps_is_refused():
    with pytest.raises(ProtocolError, match="host a: inventory of step 1 lacks its blob bitmap.*same mtc version"):
        HostInventory.from_wire("a", {"steps": [{"step": 1, "blobs": 1, "local_blobs": 1}]})
    for bad in (None, [], {"steps": {}}, {"steps": [{"step": "1", "blobs": 1, "local_blobs": 1}]}):
        with pytest.raises(ProtocolError, match="host a: malformed inventory"):
            HostInventory.from_wire("a", bad)


def test_a_peer_pull_answer_is_parsed_into_a_value_and_garbage_is_refused():
    res = PullResult.from_wire("h", {"pulled": 2, "pulled_bytes": 10, "failed": [[blob(1), [["p", "timeout"]]]],
                                     "bad_copies": [[blob(2), "q", "hash"]], "removed_bad_copies": [[blob(2), "q"]]})
    assert (res.pulled, res.pulled_bytes, res.error) == (2, 10, None)
    assert res.failed_blobs == {blob(1)} and res.failed == ((blob(1), (("p", "timeout"),)),)
    assert res.bad_copies == ((blob(2), "q", "hash"),) and res.removed_bad_copies == ((blob(2), "q"),)
    assert PullResult.unreachable("h", "down").error == "down"
    for bad in (None, {"failed": [1]}, {"pulled": "x"}, {"bad_copies": [["a"]]}):
        with pytest.raises(ProtocolError, match="host h: malformed peer pull answer"):
            PullResult.from_wire("h", bad)


def test_an_inventory_says_which_pulls_of_a_step_failed_and_garbage_is_refused():
    doc = {"steps": [], "pull_failures": [{"step": 3, "error": "ramdisk full: it lacks 1.00 MiB", "age_s": 2.5}]}
    assert HostInventory.from_wire("a", doc).pull_failures == ((3, "ramdisk full: it lacks 1.00 MiB", 2.5),)
    assert HostInventory.from_wire("a", {"steps": []}).pull_failures == ()  # none (or an older sidecar)
    for bad in ({}, [{"step": "3", "error": "x", "age_s": 1}], [{"step": 3, "age_s": 1}], [[3, "x", 1]]):
        with pytest.raises(ProtocolError, match="host a: inventory 'pull_failures'"):
            HostInventory.from_wire("a", {"steps": [], "pull_failures": bad})


def test_a_lost_writers_part_in_pieces_makes_a_view_by_writers_only_when_the_pieces_cover_it():
    """The inventories' pieces of a lost writer's part (each a bitmap over the part's sorted blob names):
    ORed, they cover it, and the step is viewed by its writers from the header; a blob no piece holds
    leaves the step to its rows. Hosts that agree on another manifest do not count."""
    from mtc.shared import format as fmt

    sharding = {"type": "named", "mesh_shape": [4], "axis_names": ["x"], "device_ids": [0, 1, 2, 3], "spec": ["x"]}
    header = fmt.StepHeader(step=1, digest="m" * 64, arrays=(fmt.ArrayRecord(
        key="w", kind="jax", dtype="float32", shape=(8,), sharding=sharding),), tree=None,
        parts=tuple((h, "p") for h in ("h0", "h1", "h2", "h3")),
        topology={"devices": {"h0": [0], "h1": [1], "h2": [2], "h3": [3]}}, fingerprint={})

    def row(host: str, pieces=(), manifest="m" * 64) -> dict:
        own = f"{int(host[1:]):064x}"
        return {"step": 1, "blobs": 3, "local_blobs": 3, "step_blobs": 12, "digest": "d" * 64, "held": "fff",
                "manifest": manifest, "own": own, "copies": [own], "pieces": [list(p) for p in pieces]}

    def views(rows: dict) -> dict:
        inv = {h: HostInventory.from_wire(h, {"host": h, "steps": [r]}) for h, r in rows.items()}
        return step_views(inv, None, lambda s, d: header if d == "m" * 64 else None)

    a, b = protocol.encode_bitmap([True, False, True]), protocol.encode_bitmap([False, True, False])
    v = views({"h1": row("h1", [("h0", 3, a)]), "h2": row("h2", [("h0", 3, b)]), "h3": row("h3")})[1]
    assert v.by_writers and v.lost == ("h0",) and v.restorable
    assert {w: list(hs) for w, hs in v.pieces.items()} == {"h0": ["h1", "h2"]}  # most held first
    assert v.sources["h0"] == ("h1", "h2") and "h0" not in v.part_holders
    # The middle blob is held by no piece: the rows decide (here every host's bitmap says who holds what).
    v = views({"h1": row("h1", [("h0", 3, a)]), "h2": row("h2"), "h3": row("h3")})[1]
    assert not v.by_writers and not v.pieces
    # A host of another manifest holds nothing of this one.
    v = views({"h1": row("h1", [("h0", 3, a)]), "h2": row("h2", [("h0", 3, b)], manifest="x" * 64),
               "h3": row("h3")})[1]
    assert v.manifest == "m" * 64 and not v.by_writers and not v.pieces
