"""How the head reaches the sidecars (docs/architecture.md, "The seam"): the ``Dispatcher``
interface and its values (``interface``), its two transports (``colocated``, ``cluster``), what
they share (``staging``, ``topology``) and the choice between them (``factory``)."""
