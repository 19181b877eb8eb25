"""Deployment and operator tooling on top of the head: the ``mtc`` CLI (``cli``), the JobSet
renderer (``manifests``), the demo (``demo``), ``mtc status`` (``status``) and the checkpoint
interval planner (``plan``). Nothing in the training path imports this package."""
