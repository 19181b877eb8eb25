"""Which devices belong to which worker host and slice.

``Topology`` is one frozen value with two constructors:

- ``Topology.from_devices(devices)`` on Pathways: a device's slice is its ``slice_index``
  attribute, and its host is its colocated CPU device (``colocated_cpu_devices``: every
  accelerator of one host maps to that host's CPU device, where its sidecar runs).
- ``Topology.from_spec(path, devices)`` in cluster mode: the head's local devices (sorted by
  id) are handed out in order to the hosts of the cluster spec, ``devices`` of them each, so
  2 slices x 2 hosts x 2 devices needs 8 devices in the head.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from mtc.shared import protocol
from mtc.shared.errors import ConfigError

__all__ = ["HostInfo", "Topology"]


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """One worker host: id, slice, control address (None on Pathways) and its device ids."""

    id: str
    slice: int
    address: str | None
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Hosts (in a fixed order) and the device id -> host id mapping they imply."""

    hosts: tuple[HostInfo, ...]
    _host_of: dict = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _by_id: dict = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        host_of: dict[int, str] = {}
        by_id: dict[str, HostInfo] = {}
        for h in self.hosts:
            if h.id in by_id:
                raise ConfigError(f"topology names host {h.id!r} twice")
            by_id[h.id] = h
            for d in h.devices:
                if d in host_of:
                    raise ConfigError(f"device {d} is assigned to two hosts ({host_of[d]} and {h.id})")
                host_of[d] = h.id
        object.__setattr__(self, "_host_of", host_of)
        object.__setattr__(self, "_by_id", by_id)

    # --- queries ---------------------------------------------------------------------------

    @property
    def host_ids(self) -> list[str]:
        return [h.id for h in self.hosts]

    @property
    def num_slices(self) -> int:
        return len({h.slice for h in self.hosts})

    @property
    def device_ids(self) -> list[int]:
        return sorted(self._host_of)

    def host(self, host_id: str) -> HostInfo:
        try:
            return self._by_id[host_id]
        except KeyError:
            raise ConfigError(f"host {host_id!r} is not in the topology; hosts: {self.host_ids}") from None

    def host_of(self, device_id: int) -> str:
        """The id of the host that holds device ``device_id``."""
        try:
            return self._host_of[int(device_id)]
        except KeyError:
            raise ConfigError(f"device {device_id} belongs to no host of the topology (devices "
                              f"{self.device_ids[:8]}{'...' if len(self._host_of) > 8 else ''}); "
                              "put the state on the devices the topology covers") from None

    def slice_of(self, host_id: str) -> int:
        return self.host(host_id).slice

    # --- constructors ----------------------------------------------------------------------

    @classmethod
    def from_spec(cls, path: str | os.PathLike, devices: Sequence[Any] | None = None) -> "Topology":
        """Cluster mode: assign ``devices`` (default ``jax.devices()``), sorted by id, to the
        hosts of the spec at ``path`` in order."""
        spec = protocol.ClusterSpec.read(path)
        if devices is None:
            import jax

            devices = jax.devices()
        devs = sorted(devices, key=lambda d: d.id)
        need = sum(h.devices for h in spec.hosts)
        if need != len(devs):
            raise ConfigError(
                f"cluster spec {path} has {len(spec.hosts)} hosts with {need} devices in all, but the head has "
                f"{len(devs)} JAX devices; they must be equal. On a CPU head set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax is imported "
                "(or start the cluster with a matching devices_per_host)")
        hosts, i = [], 0
        for h in spec.hosts:
            hosts.append(HostInfo(h.id, h.slice, h.address, tuple(int(d.id) for d in devs[i : i + h.devices])))
            i += h.devices
        return cls(tuple(hosts))

    @classmethod
    def from_devices(cls, devices: Sequence[Any],
                     cpu_devices: Sequence[Any] | Callable[[Sequence[Any]], Sequence[Any]] | None = None
                     ) -> "Topology":
        """Pathways: hosts from each device's ``slice_index`` and colocated CPU device.

        ``cpu_devices`` is the colocated CPU device of each device, in the same order, or a
        function that computes them (default: ``colocated_python.colocated_cpu_devices``).
        Devices without ``slice_index`` are in slice 0. Hosts are named ``s<slice>-h<n>``,
        with ``n`` counting the slice's CPU devices in order of their ids.
        """
        devices = list(devices)
        if not devices:
            raise ConfigError("Topology.from_devices needs at least one device")
        if cpu_devices is None:
            from jax.experimental import colocated_python

            cpu_devices = colocated_python.colocated_cpu_devices
        cpus = list(cpu_devices(devices) if callable(cpu_devices) else cpu_devices)
        if len(cpus) != len(devices):
            raise ConfigError(f"got {len(cpus)} colocated CPU devices for {len(devices)} devices")
        groups: dict[tuple[int, int], list[int]] = {}
        slice_of_cpu: dict[int, int] = {}
        for dev, cpu in zip(devices, cpus):
            sl = getattr(dev, "slice_index", None)
            sl = 0 if sl is None else int(sl)
            cid = int(cpu.id)
            if slice_of_cpu.setdefault(cid, sl) != sl:
                raise ConfigError(f"CPU device {cid} is colocated with devices of slices "
                                  f"{slice_of_cpu[cid]} and {sl}; a host belongs to one slice")
            groups.setdefault((sl, cid), []).append(int(dev.id))
        hosts = []
        for sl in sorted({s for s, _ in groups}):
            for n, cid in enumerate(sorted(c for s, c in groups if s == sl)):
                hosts.append(HostInfo(f"s{sl}-h{n}", sl, None, tuple(sorted(groups[(sl, cid)]))))
        return cls(tuple(hosts))
