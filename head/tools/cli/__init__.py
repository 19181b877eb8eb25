"""The ``mtc`` command line: the parser (``main``) and one module per command, named by the
command (``size``, ``plan``, ``status``, ``export``, ``verify``, ``restore_version``,
``manifests``, ``images``, ``tls``). ``python -m mtc.head.tools.cli`` is ``mtc``."""
