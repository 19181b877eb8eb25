"""Prometheus metrics of one sidecar daemon (cluster mode): its ramdisk, peer traffic, jobs and errors.

``serve_metrics(port, service)`` serves ``/metrics`` for a ``SidecarService`` (a private registry, read
at each scrape), labelled with the service's host id, on ``mtc.shared.scrape_server``'s bounded server
(``MAX_SCRAPES`` scrapes at once, ``SCRAPE_TIMEOUT_S`` from a connection's accept to the end of its
request, so slow senders hold a slot no longer than that):

- ``mtc_sidecar_ramdisk_used_bytes`` (mtc's blobs), ``mtc_sidecar_ramdisk_free_bytes`` (what the
  filesystem has left), ``mtc_sidecar_ramdisk_total_bytes``, ``mtc_sidecar_ramdisk_pool_bytes``
  (collected files kept for reuse, freed when a step needs their room);
- ``mtc_sidecar_committed_steps``, ``mtc_sidecar_newest_step`` (absent while none is committed);
- ``mtc_sidecar_peer_bytes_total{direction}``: bytes its peer service sent to peers pulling from it
  (``out``) and received from peers pushing to it (``in``); ``mtc_sidecar_peer_blobs_total{direction}``,
  ``mtc_sidecar_peer_refused_total`` (connections without the job token);
- ``mtc_sidecar_jobs_running``: its long operations running now (backup uploads, fetches and scrubs, peer pulls);
- ``mtc_sidecar_lease_generation``: the generation of the head that holds this host (it rises when a new
  head takes the hosts: ``changes()`` over it counts fencings);
- ``mtc_sidecar_backup_scrub_blobs_total{outcome}``: backup blobs its scrubs hashed (``checked``), found
  corrupt or missing in the store (``bad``) and re-uploaded from its ramdisk (``repaired``);
- ``mtc_sidecar_untrusted_objects_total{kind}``: objects read from shared storage that failed the job
  key's check (a backup seal or finalize marker that is not the job's), ignored as if absent;
- ``mtc_sidecar_backup_finalizes_superseded_total{why}``: backup finalizes that gave way to another
  finalize's marker (that backup was not made);
- ``mtc_sidecar_errors_total{logger}``: error records its ``mtc`` loggers wrote since the server started.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Iterator

from mtc.shared import job_key, scrape_server
from mtc.shared.errors import ConfigError
from mtc.shared.scrape_server import ScrapeServer
from mtc.sidecar.backup import fence

log = logging.getLogger(__name__)

# mtc.shared.scrape_server's bounds, the same as the head's /metrics.
MAX_SCRAPES = scrape_server.MAX_SCRAPES  # connections served at once; one more is closed at once (a scraper asks again)
SCRAPE_TIMEOUT_S = scrape_server.REQUEST_DEADLINE_S  # from a connection's accept to the end of its request


class MetricsServer:
    """A running ``/metrics`` server of one sidecar; ``close()`` stops it."""

    def __init__(self, server: ScrapeServer, errors: "_ErrorCounter"):
        self._server, self._errors = server, errors

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def refused(self) -> int:
        """Connections closed unserved because ``MAX_SCRAPES`` were being served."""
        return self._server.refused

    def close(self) -> None:
        """Stop serving and stop counting errors. Safe to call twice."""
        if self._errors is not None:
            logging.getLogger("mtc").removeHandler(self._errors)
            self._errors = None
            self._server.close()


def serve_metrics(port: int, service: Any, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``service``'s metrics at ``http://addr:port/metrics`` (port 0: any free port, see
    ``MetricsServer.port``) from a thread of this process, until ``close()``. The daemon binds them
    where its control port binds unless ``--metrics-host`` says otherwise."""
    from prometheus_client import CollectorRegistry

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port {port} is out of range; use 1..65535 (0: any free port)")
    errors = _ErrorCounter()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SidecarCollector(service, errors))
    try:
        server = ScrapeServer(addr, port, registry, name=f"host {service.host_id}", logger=log)
    except (OSError, OverflowError) as e:
        raise ConfigError(f"host {service.host_id}: cannot serve metrics on {addr}:{port}: {e}; give --metrics-port "
                          "a free port (and --metrics-host an address of this host)") from e
    logging.getLogger("mtc").addHandler(errors)
    log.info("host %s: metrics on %s:%d/metrics", service.host_id, addr, server.port)
    return MetricsServer(server, errors)


class _ErrorCounter(logging.Handler):
    """Counts the error records of the ``mtc`` loggers, by logger name."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.counts: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._count_lock:
            self.counts[record.name] = self.counts.get(record.name, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self.counts)


class _SidecarCollector:
    def __init__(self, service: Any, errors: _ErrorCounter):
        self._service = service
        self._errors = errors

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        svc = self._service
        host = [svc.host_id]

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["host"])
            if value is not None and math.isfinite(_as_float(value)):  # a value no float holds is left out
                g.add_metric(host, value)
            return g

        usage = svc.store.space.usage()
        yield gauge("mtc_sidecar_ramdisk_used_bytes", "Bytes of mtc's blobs on this host's ramdisk", usage["blob_bytes"])
        yield gauge("mtc_sidecar_ramdisk_free_bytes", "Bytes free on this host's ramdisk", usage["free_bytes"])
        yield gauge("mtc_sidecar_ramdisk_total_bytes", "Size of this host's ramdisk", usage["total_bytes"])
        yield gauge("mtc_sidecar_ramdisk_pool_bytes", "Collected files kept for reuse", usage["free_pool_bytes"])
        steps = usage["committed_steps"]
        yield gauge("mtc_sidecar_committed_steps", "Steps committed on this host", len(steps))
        yield gauge("mtc_sidecar_newest_step", "Newest step committed on this host", max(steps) if steps else None)
        yield gauge("mtc_sidecar_jobs_running", "Long operations running (backup uploads, fetches and scrubs, peer pulls)",
                    svc.jobs.running())
        lease = svc.lease.current()
        yield gauge("mtc_sidecar_lease_generation", "Generation of the head holding this host",
                    lease["generation"] if lease else None)
        # The peer service's own counters (its server counts every blob it sends and receives).
        stats = svc.peer_stats()
        nbytes = CounterMetricFamily("mtc_sidecar_peer_bytes", "Blob bytes this host's peer service sent and "
                                     "received", labels=["host", "direction"])
        blobs = CounterMetricFamily("mtc_sidecar_peer_blobs", "Blobs this host's peer service sent and received",
                                    labels=["host", "direction"])
        for direction, key in (("out", "sent"), ("in", "received")):
            nbytes.add_metric([*host, direction], stats.get(f"{key}_bytes", 0))
            blobs.add_metric([*host, direction], stats.get(f"{key}_blobs", 0))
        yield nbytes
        yield blobs
        refused = CounterMetricFamily("mtc_sidecar_peer_refused", "Peer connections refused", labels=["host"])
        refused.add_metric(host, stats.get("refused", 0))
        yield refused
        scrub = CounterMetricFamily("mtc_sidecar_backup_scrub_blobs", "Backup blobs this host's scrubs hashed "
                                    "(checked), found corrupt or missing (bad), re-uploaded good (repaired)",
                                    labels=["host", "outcome"])
        for outcome, n in svc.backup_scrub_counts().items():
            scrub.add_metric([*host, outcome], n)
        yield scrub
        untrusted = CounterMetricFamily("mtc_sidecar_untrusted_objects", "Objects read from shared storage that "
                                        "failed the job key's check (ignored as if absent), by kind",
                                        labels=["host", "kind"])
        for kind, n in sorted(job_key.rejected_counts().items()):
            untrusted.add_metric([*host, kind], n)
        yield untrusted
        gave_way = CounterMetricFamily("mtc_sidecar_backup_finalizes_superseded", "Backup finalizes on this host that "
                                       "gave way to another finalize's marker (that backup was not made), by why",
                                       labels=["host", "why"])
        for why, n in sorted(fence.superseded.items()):
            gave_way.add_metric([*host, why], n)
        yield gave_way
        errs = CounterMetricFamily("mtc_sidecar_errors", "Error records of mtc's loggers on this host",
                                   labels=["host", "logger"])
        for name, n in sorted(self._errors.snapshot().items()):
            errs.add_metric([*host, name], n)
        yield errs


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        return math.nan
