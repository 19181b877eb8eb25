"""Cluster dispatch: sidecar daemons reached over local sockets (``dispatcher``), one connection
per host and lane (``client``), the calls and fan-outs over them (``lanes``) and the restore reads
(``reads``)."""
