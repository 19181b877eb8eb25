"""``covered_by_shares``: whether a step's copies exist already, told from the hosts' own shares
alone (no step manifest), and every case where it cannot be told so (then the manifest plans)."""

from __future__ import annotations

from mtc.head.dispatch.interface import HostInventory, StepHolding
from mtc.head.replication.plan import ReplicationStrategy, covered_by_shares, plan_shares
from mtc.shared import protocol

TWO_SLICES = {"s0-h0": 0, "s0-h1": 0, "s1-h0": 1, "s1-h1": 1}
ONE_SLICE = {"h0": 0, "h1": 0}


def share(names: list[str]) -> str:
    return protocol.blob_list_digest(sorted(names))


def row(step: int, names: list[str], held: int | None = None, manifest: str = "m1", own: str | None = None):
    n = len(names)
    held = n if held is None else held
    return StepHolding(step, n, held, n, share(names), protocol.encode_bitmap([i < held for i in range(n)]),
                       manifest, True, share(names) if own is None else own)


def inventories(rows: dict[str, StepHolding | None]) -> dict[str, HostInventory]:
    return {h: (HostInventory(h, (r,)) if r is not None else HostInventory.unreachable(h, "down"))
            for h, r in rows.items()}


# Data-parallel over the slices, FSDP within each: s0-hK and s1-hK hold equal shares.
A, B = ["a1", "a2"], ["b1", "b2", "b3"]
TWINS = {"s0-h0": A, "s0-h1": B, "s1-h0": A, "s1-h1": B}


def test_data_parallel_twins_on_two_slices_cover_factor_two():
    inv = inventories({h: row(7, n) for h, n in TWINS.items()})
    assert covered_by_shares(inv, 7, "m1", TWINS, ReplicationStrategy(2), TWO_SLICES)
    assert not covered_by_shares(inv, 7, "m1", TWINS, ReplicationStrategy(3), TWO_SLICES)  # only 2 slices


def test_a_twin_that_lacks_a_blob_of_its_share_does_not_count():
    inv = inventories({**{h: row(7, n) for h, n in TWINS.items()}, "s1-h1": row(7, B, held=2)})
    assert not covered_by_shares(inv, 7, "m1", TWINS, ReplicationStrategy(2), TWO_SLICES)


def test_twins_in_one_slice_of_two_are_one_domain():
    shares = {"s0-h0": A, "s0-h1": A, "s1-h0": B, "s1-h1": B}
    inv = inventories({h: row(7, n) for h, n in shares.items()})
    assert not covered_by_shares(inv, 7, "m1", shares, ReplicationStrategy(2), TWO_SLICES)


def test_with_one_slice_the_domains_are_hosts():
    inv = inventories({"h0": row(3, A), "h1": row(3, A)})
    assert covered_by_shares(inv, 3, "m1", ["h0", "h1"], ReplicationStrategy(2), ONE_SLICE)
    inv = inventories({"h0": row(3, A), "h1": row(3, B)})  # FSDP over both hosts: distinct shares
    assert not covered_by_shares(inv, 3, "m1", ["h0", "h1"], ReplicationStrategy(2), ONE_SLICE)


def test_it_cannot_tell_without_every_saving_host_under_the_same_manifest():
    strategy = ReplicationStrategy(2)
    down = inventories({**{h: row(7, n) for h, n in TWINS.items()}, "s0-h1": None})
    assert not covered_by_shares(down, 7, "m1", TWINS, strategy, TWO_SLICES)
    other = inventories({**{h: row(7, n) for h, n in TWINS.items()}, "s1-h0": row(7, A, manifest="m2")})
    assert not covered_by_shares(other, 7, "m1", TWINS, strategy, TWO_SLICES)
    old = inventories({**{h: row(7, n) for h, n in TWINS.items()}, "s0-h0": row(7, A, own="")})
    assert not covered_by_shares(old, 7, "m1", TWINS, strategy, TWO_SLICES)
    wrong_step = inventories({h: row(8, n) for h, n in TWINS.items()})
    assert not covered_by_shares(wrong_step, 7, "m1", TWINS, strategy, TWO_SLICES)
    assert not covered_by_shares(inventories({}), 7, "m1", [], strategy, TWO_SLICES)


def test_a_host_the_topology_does_not_know_adds_no_domain():
    inv = inventories({"s0-h0": row(7, A), "s9-h0": row(7, A)})
    assert not covered_by_shares(inv, 7, "m1", ["s0-h0"], ReplicationStrategy(2), {"s0-h0": 0, "s1-h0": 1})


# --- plan_shares: the copies to make, share by share -------------------------------------------

C, D = ["c1"], ["d1", "d2"]
FSDP = {"s0-h0": A, "s0-h1": B, "s1-h0": C, "s1-h1": D}  # FSDP over both slices: no twins


def full_row(step: int, own: list[str], holds: list[list[str]], manifest: str = "m1") -> StepHolding:
    """A host that keeps the whole manifest: it lists the shares it holds whole (its own among them)."""
    return StepHolding(step, len(own), len(own), 9, "x", "", manifest, False, share(own),
                       tuple(share(h) for h in holds))


def test_shares_without_twins_go_to_the_other_slice_spread_over_its_hosts():
    inv = inventories({h: row(7, n) for h, n in FSDP.items()})
    strategy = ReplicationStrategy(2)
    assert not covered_by_shares(inv, 7, "m1", FSDP, strategy, TWO_SLICES)
    plan = plan_shares(inv, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets=FSDP)
    assert plan == {"s1-h0": [("s0-h0", ["s0-h0"])], "s1-h1": [("s0-h1", ["s0-h1"])],
                    "s0-h0": [("s1-h0", ["s1-h0"])], "s0-h1": [("s1-h1", ["s1-h1"])]}
    # Once the receivers report the copies they keep, every share is on both slices.
    after = inventories({"s0-h0": full_row(7, A, [A, C]), "s0-h1": full_row(7, B, [B, D]),
                         "s1-h0": full_row(7, C, [C, A]), "s1-h1": full_row(7, D, [D, B])})
    assert covered_by_shares(after, 7, "m1", FSDP, strategy, TWO_SLICES)
    assert plan_shares(after, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets=FSDP) == {}
    # A copy reported but not held whole does not count (the receiver lists only whole shares).
    partial = inventories({"s0-h0": full_row(7, A, [A, C]), "s0-h1": full_row(7, B, [B]),
                           "s1-h0": full_row(7, C, [C, A]), "s1-h1": full_row(7, D, [D, B])})
    assert not covered_by_shares(partial, 7, "m1", FSDP, strategy, TWO_SLICES)
    assert plan_shares(partial, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets=FSDP) == {
        "s0-h1": [("s1-h1", ["s1-h1"])]}  # the owner's position in the other slice


def test_with_one_slice_each_share_goes_to_the_next_host():
    hosts = {f"h{i}": 0 for i in range(4)}
    shares = {f"h{i}": [f"b{i}"] for i in range(4)}
    inv = inventories({h: row(2, n) for h, n in shares.items()})
    plan = plan_shares(inv, 2, "m1", list(hosts), ReplicationStrategy(2), hosts, targets=hosts)
    assert plan == {"h1": [("h0", ["h0"])], "h2": [("h1", ["h1"])], "h3": [("h2", ["h2"])], "h0": [("h3", ["h3"])]}


def test_a_host_down_receives_nothing_and_a_share_nobody_holds_whole_is_left_to_the_blob_plan():
    inv = inventories({**{h: row(7, n) for h, n in FSDP.items()}, "s0-h1": row(7, B, held=1)})
    plan = plan_shares(inv, 7, "m1", list(FSDP), ReplicationStrategy(2), TWO_SLICES,
                       targets={"s0-h0", "s0-h1", "s1-h0"})
    assert "s1-h1" not in plan  # not a target (down, say)
    assert all(owner != "s0-h1" for rows in plan.values() for owner, _ in rows)  # B is held in part only
    assert plan["s1-h0"] == [("s0-h0", ["s0-h0"])]
    # The owner's counterpart on the other slice cannot take it: the next host there does.
    inv = inventories({h: row(7, n) for h, n in FSDP.items()})
    plan = plan_shares(inv, 7, "m1", list(FSDP), ReplicationStrategy(2), TWO_SLICES,
                       targets={"s0-h0", "s0-h1", "s1-h0"})
    assert plan["s1-h0"] == [("s0-h0", ["s0-h0"]), ("s0-h1", ["s0-h1"])]
    assert plan_shares(inventories({}), 7, "m1", list(FSDP), ReplicationStrategy(2), TWO_SLICES,
                       targets=FSDP) is None


# --- a saving host that does not answer: its share from the header's twins, or the hosts that keep its part


def test_a_saving_host_down_is_told_by_its_twins_or_by_the_keepers_of_its_part():
    """Without ``twins`` (the header's word) a saving host that cannot be asked leaves the shares unable to
    tell; with it, the host's share is its twins' (equal boxes: equal shares), or, without a twin, a share
    of its own held by the hosts that list its part (``StepHolding.parts``), or held by no host while it
    is down. A share whose owner is down is copied into the owner's own slice too, which lacks it now."""
    strategy = ReplicationStrategy(2)
    down = inventories({**{h: row(7, n) for h, n in TWINS.items()}, "s1-h1": None})
    assert not covered_by_shares(down, 7, "m1", TWINS, strategy, TWO_SLICES)
    assert plan_shares(down, 7, "m1", list(TWINS), strategy, TWO_SLICES, targets=TWINS) is None
    twins = {"s0-h0": ("s1-h0",), "s1-h0": ("s0-h0",), "s0-h1": ("s1-h1",), "s1-h1": ("s0-h1",)}
    assert not covered_by_shares(down, 7, "m1", TWINS, strategy, TWO_SLICES, twins)  # B on slice 0 alone now
    plan = plan_shares(down, 7, "m1", list(TWINS), strategy, TWO_SLICES, targets=set(TWINS) - {"s1-h1"},
                       twins=twins)
    assert plan == {"s1-h0": [("s0-h1", ["s0-h1"])]}, plan
    after = inventories({"s0-h0": row(7, A), "s0-h1": row(7, B), "s1-h0": full_row(7, A, [A, B]), "s1-h1": None})
    assert covered_by_shares(after, 7, "m1", TWINS, strategy, TWO_SLICES, twins)
    # FSDP: s1-h1's part (D) has no twin; s0-h1 keeps a copy of it and lists it.
    alone = {h: () for h in FSDP}
    keeps = StepHolding(7, 3, 3, 9, "x", "", "m1", False, share(B), (share(B), share(D)), ("s1-h1",))
    inv = inventories({"s0-h0": full_row(7, A, [A, C]), "s0-h1": keeps, "s1-h0": full_row(7, C, [C, A]),
                       "s1-h1": None})
    assert not covered_by_shares(inv, 7, "m1", FSDP, strategy, TWO_SLICES, alone)
    plan = plan_shares(inv, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets={"s0-h0", "s0-h1", "s1-h0"},
                       twins=alone)
    # B's copy on s1-h1 is gone and D is on slice 0 alone: both go to s1-h0, the host of slice 1 that answers.
    assert plan == {"s1-h0": [("s0-h1", ["s0-h1"]), ("s1-h1", ["s0-h1"])]}, plan
    # Nobody lists the part of a host that is down and has no twin: a share no host holds now. The others'
    # shares are planned (B to slice 1); its own waits for it (no copy can be made before it is back).
    bare = inventories({"s0-h0": full_row(7, A, [A, C]), "s0-h1": full_row(7, B, [B]),
                        "s1-h0": full_row(7, C, [C, A]), "s1-h1": None})
    assert not covered_by_shares(bare, 7, "m1", FSDP, strategy, TWO_SLICES, alone)
    plan = plan_shares(bare, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets={"s0-h0", "s0-h1", "s1-h0"},
                       twins=alone)
    assert plan == {"s1-h0": [("s0-h1", ["s0-h1"])]}, plan
    # Back, it answers for its share (D, whole on slice 1 only): the shares tell again, D is copied to slice 0.
    back = inventories({"s0-h0": full_row(7, A, [A, C]), "s0-h1": full_row(7, B, [B]),
                        "s1-h0": full_row(7, C, [C, A, B]), "s1-h1": row(7, D)})
    assert plan_shares(back, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets=FSDP, twins=None) == {
        "s0-h1": [("s1-h1", ["s1-h1"])]}
    # A saving host that answers without the step (its ramdisk lost) and has no twin: the shares cannot tell
    # (its blobs may be spread over hosts, which the rows find).
    wiped = inventories({"s0-h0": full_row(7, A, [A, C]), "s0-h1": full_row(7, B, [B]),
                         "s1-h0": full_row(7, C, [C, A]), "s1-h1": row(9, D)})
    assert plan_shares(wiped, 7, "m1", list(FSDP), strategy, TWO_SLICES, targets=FSDP, twins=alone) is None
