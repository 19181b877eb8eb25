"""What the ``mtc`` command modules share: an exception as the one line a command prints."""

from __future__ import annotations


def last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else "(no message)"


def missing_local_root(root: str) -> str | None:
    """Why a local backup root cannot be read, when it does not exist (None for one that does, and for
    ``gs://`` roots): a read-only command says so instead of creating it or reading it as empty."""
    from pathlib import Path

    text = str(root)
    if "://" in text and not text.startswith("file://"):
        return None
    path = Path(text[len("file://"):] if text.startswith("file://") else text)
    if path.is_dir():
        return None
    what = "is not a folder" if path.exists() else "does not exist"
    return (f"the backup root {root} {what}: nothing was backed up there; check --base-output-directory and "
            "--run-name (the backups are under <base_output_directory>/<run_name>/mtc)")
