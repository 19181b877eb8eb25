"""Deployment and operator tooling on top of the head: the ``mtc`` command line (``cli``, one
module per command), the JobSet renderer and checker (``k8s``), the demo (``demo``), the
checkpoint interval planner's model (``plan``) and where the tools read a job's steps from
(``sources``). Nothing in the training path imports this package."""
