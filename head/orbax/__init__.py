"""mtc with Orbax's surface: the Orbax-compatible checkpoint manager (``compat``, which never
imports orbax-checkpoint) and a step written out as a standard Orbax checkpoint, MaxText's layout
(``export``, which imports orbax-checkpoint when it runs)."""
