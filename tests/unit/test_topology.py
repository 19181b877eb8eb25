"""Topology (mtc.head.dispatch.topology): from a cluster spec, and from Pathways-style device attributes."""

from __future__ import annotations

import jax
import pytest

from mtc.head.dispatch.topology import HostInfo, Topology
from mtc.shared.errors import ConfigError
from mtc.shared.protocol import ClusterSpec, HostSpec

pytestmark = pytest.mark.unit


class Dev:
    """A stand-in for a Pathways accelerator device: an id and a slice_index."""

    def __init__(self, id, slice_index=None):
        self.id = id
        if slice_index is not None:
            self.slice_index = slice_index


class Cpu:
    def __init__(self, id):
        self.id = id


def write_spec(path, slices=2, hosts=2, devices=2):
    spec = ClusterSpec(tuple(HostSpec(f"s{s}-h{h}", s, f"127.0.0.1:{7000 + 10 * s + h}", devices)
                             for s in range(slices) for h in range(hosts)))
    spec.write(path)
    return path


def test_from_spec_hands_out_devices_in_id_order(tmp_path):
    devs = [Dev(i) for i in (5, 1, 7, 0, 3, 2, 6, 4)]
    topo = Topology.from_spec(write_spec(tmp_path / "c.json"), devs)
    assert topo.host_ids == ["s0-h0", "s0-h1", "s1-h0", "s1-h1"]
    assert [h.devices for h in topo.hosts] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [topo.host_of(d) for d in range(8)] == ["s0-h0"] * 2 + ["s0-h1"] * 2 + ["s1-h0"] * 2 + ["s1-h1"] * 2
    assert topo.num_slices == 2 and topo.slice_of("s1-h0") == 1
    assert topo.host("s0-h1").address == "127.0.0.1:7001"
    with pytest.raises(ConfigError, match="device 8 belongs to no host"):
        topo.host_of(8)


def test_from_spec_with_the_jax_devices_of_the_test_session(tmp_path):
    topo = Topology.from_spec(write_spec(tmp_path / "c.json"))
    assert topo.device_ids == sorted(d.id for d in jax.devices())


def test_device_count_mismatch_names_both_numbers_and_the_flag(tmp_path):
    path = write_spec(tmp_path / "c.json", slices=2, hosts=2, devices=3)
    with pytest.raises(ConfigError) as e:
        Topology.from_spec(path, [Dev(i) for i in range(8)])
    msg = str(e.value)
    assert "12 devices" in msg and "8 JAX devices" in msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=12" in msg


def test_from_devices_groups_by_slice_and_colocated_cpu():
    # 2 slices x 2 hosts x 4 chips; the CPU device of a host is shared by its 4 chips.
    devs, cpus = [], []
    for s in range(2):
        for h in range(2):
            for c in range(4):
                devs.append(Dev(100 + 16 * s + 4 * h + c, slice_index=s))
                cpus.append(Cpu(1000 + 2 * s + h if s == 0 else 900 + h))  # ids not in slice order
    topo = Topology.from_devices(devs, cpus)
    assert topo.host_ids == ["s0-h0", "s0-h1", "s1-h0", "s1-h1"]
    assert topo.host("s0-h1").devices == (104, 105, 106, 107)
    assert topo.host("s1-h0").devices == (116, 117, 118, 119)  # CPU 900: the lower id of slice 1
    assert topo.host("s1-h0").slice == 1 and topo.host("s1-h0").address is None
    assert topo.host_of(123) == "s1-h1"


def test_from_devices_takes_a_function_and_defaults_to_slice_0():
    devs = [Dev(i) for i in range(4)]
    topo = Topology.from_devices(devs, lambda ds: [Cpu(50 + d.id // 2) for d in ds])
    assert [(h.id, h.slice, h.devices) for h in topo.hosts] == [("s0-h0", 0, (0, 1)), ("s0-h1", 0, (2, 3))]


def test_from_devices_on_the_cpu_backend_is_one_host_per_device():
    topo = Topology.from_devices(jax.devices())
    assert len(topo.hosts) == len(jax.devices())


def test_from_devices_refuses_inconsistent_input():
    with pytest.raises(ConfigError, match="2 colocated CPU devices for 3 devices"):
        Topology.from_devices([Dev(0), Dev(1), Dev(2)], [Cpu(0), Cpu(1)])
    with pytest.raises(ConfigError, match="slices 0 and 1"):
        Topology.from_devices([Dev(0, 0), Dev(1, 1)], [Cpu(9), Cpu(9)])


def test_topology_refuses_a_device_on_two_hosts():
    with pytest.raises(ConfigError, match="device 1 is assigned to two hosts"):
        Topology((HostInfo("a", 0, None, (0, 1)), HostInfo("b", 0, None, (1, 2))))
    t = Topology((HostInfo("a", 0, None, (0,)),))
    assert t == Topology((HostInfo("a", 0, None, (0,)),)) and hash(t) == hash(Topology((HostInfo("a", 0, None, (0,)),)))
