"""Stand-ins for Pathways on CPU: what MaxText's elastic mode needs from Pathways, for the goodput
harness's ``slice_lost_elastic`` runs only (never imported by mtc).

MaxText's elastic mode (``elastic_enabled=True``) runs only where
``pathwaysutils.is_pathways_backend_used()`` (``maxtext.utils.elastic_utils.elastic_enabled``);
its config validation requires ``enable_single_controller=True`` (``configs/types.py``), and
``pathwaysutils.elastic``'s ``Manager`` groups the devices by their ``slice_index``, which CPU
devices do not have (``elastic.get_slice_to_devices``: AttributeError). On this machine there is
no Pathways, so ``install()`` patches, in the training process and at run time (no file of
MaxText or pathwaysutils is changed), exactly these:

- ``pathwaysutils.is_pathways_backend_used`` returns True (read by MaxText's ``elastic_utils``
  only: nothing else of MaxText, Orbax or JAX takes a Pathways path because of it);
- ``pathwaysutils.elastic.elastic.get_slice_to_devices``: the CPU devices in id order, split into
  the local sidecar cluster's slices (``MTC_CLUSTER_SPEC``), as many devices per slice as its hosts
  have (here 2 slices x 2 hosts x 1 device);
- ``pathwaysutils.elastic.elastic.DefaultSliceHealthChecker``: a slice is up while every one of
  its sidecar daemons accepts connections (on Pathways: a small computation on the slice's
  devices). A lost slice is its sidecars killed and their ramdisks wiped; it is back when the
  harness restarts them, empty, as a replaced slice comes back;
- ``pathwaysutils.elastic.manager.Manager.elastic_retry``'s ``poll_interval`` (MaxText passes
  none: pathwaysutils' default is 10 s) is ``GOODPUT_ELASTIC_POLL_S`` (default 1 s), so that the
  wait for the slice measures its return, not the poll's granularity;
- ``DECOUPLE_GCLOUD=TRUE`` (MaxText's own switch for a machine without Google Cloud): the elastic
  retry's ``clean_up_checkpoints`` lists the Orbax checkpoint directory through GCS, whose stub
  raises here otherwise. (mtc's runs write no Orbax checkpoint there.)

The devices keep no ``slice_index`` (a jaxlib ``Device`` takes no new attribute): MaxText's
``elastic_utils.live_devices`` reads ``getattr(d, "slice_index", 0)``, so every CPU device counts
as slice 0's. MaxText waits for every slice (``elastic_min_slice_count=-1``), so after a slice
loss it trains on again only once the slice is back, on the same four devices and the same mesh:
what the bit-for-bit check against the uninterrupted run needs.

Marks for the harness's stage breakdown (``goodput_probe.mark``): ``elastic_event`` when an error
reaches pathwaysutils' retry (its ``is_error_due_to_slice_down``: ``slice_down`` says whether it
retries, ``error`` the error's first line), ``slices_ready`` when the retry has its slices and
starts the attempt (MaxText's ``record_elastic_wait_end_and_reinit_start``; also before the
first attempt).
"""

from __future__ import annotations

import json
import os
import socket

FLAGS = ["elastic_enabled=True", "enable_single_controller=True", "elastic_backup_kind=checkpoint",
         "elastic_min_slice_count=-1"]


def _alive(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _spec() -> dict:
    with open(os.environ["MTC_CLUSTER_SPEC"]) as f:
        return json.load(f)


def install(mark) -> None:
    """Patch pathwaysutils for MaxText's elastic mode on CPU (see the module's docstring)."""
    os.environ["DECOUPLE_GCLOUD"] = "TRUE"
    import pathwaysutils
    from pathwaysutils.elastic import elastic, manager

    pathwaysutils.is_pathways_backend_used = lambda: True
    slices = sorted({h["slice"] for h in _spec()["hosts"]})

    def get_slice_to_devices(devices):
        devices = sorted(devices, key=lambda d: d.id)
        per = len(devices) // len(slices)
        return {s: devices[i * per:(i + 1) * per] for i, s in enumerate(slices)}

    class SidecarSliceHealth(elastic.SliceHealthChecker):
        """Stands in for Pathways' slice health check: a slice is up while all its sidecars answer."""

        def dispatch(self) -> None:
            pass

        def validate(self):
            hosts = _spec()["hosts"]
            return frozenset(s for s in self.slice_to_devices
                             if all(_alive(h["address"]) for h in hosts if h["slice"] == s))

    elastic.get_slice_to_devices = get_slice_to_devices
    elastic.DefaultSliceHealthChecker = SidecarSliceHealth

    original_retry = manager.Manager.elastic_retry
    poll = float(os.environ.get("GOODPUT_ELASTIC_POLL_S", "1"))

    def elastic_retry(self, *args, **kwargs):
        kwargs.setdefault("poll_interval", poll)
        return original_retry(self, *args, **kwargs)

    manager.Manager.elastic_retry = elastic_retry

    original_is_down = elastic.is_error_due_to_slice_down

    def is_error_due_to_slice_down(error, *args, **kwargs):
        down = original_is_down(error, *args, **kwargs)
        mark("elastic_event", slice_down=bool(down), error=f"{type(error).__name__}: {str(error)[:300]}")
        return down

    elastic.is_error_due_to_slice_down = is_error_due_to_slice_down


def install_maxtext_marks(mark) -> None:
    """``slices_ready``: the retry has its slices and starts an attempt (after MaxText is imported)."""
    from maxtext.utils import elastic_utils

    original = elastic_utils.record_elastic_wait_end_and_reinit_start

    def record(recorder):
        mark("slices_ready")
        return original(recorder)

    elastic_utils.record_elastic_wait_end_and_reinit_start = record
