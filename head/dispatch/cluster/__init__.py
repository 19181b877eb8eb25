"""Cluster dispatch: sidecar daemons reached over local sockets (``dispatcher``), one connection
to one daemon and what it is handed (``client``), the connections per host and lane and the calls
and fan-outs over them (``lanes``) and the restore reads (``reads``)."""
