"""What the ``mtc`` command modules share: an exception as the one line a command prints."""

from __future__ import annotations


def last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else "(no message)"
