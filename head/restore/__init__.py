"""Restore, head side: the plan as values (``plan``: load requests, per-host needs, per-box reads),
the orchestration that chooses a step, has hosts pull what they lack and loads (``restorer``),
and a step manifest given back to hosts that need it (``manifest_gift``)."""
