"""The Python environment the MaxText tests and benchmark run MaxText in (built once, reused).

MaxText needs Python >= 3.12 and its train loop's dependencies; the project's own venv may be
3.11. ``ensure()`` builds a virtualenv from ``requirements-cpu.txt`` (the smallest set found
to run MaxText's CPU train loop) outside the repository, under ``$MTC_CACHE`` (default
``~/.cache/mtc``), named by a hash of what it is built from, and installs this checkout's mtc
into it (``--no-deps``, editable) on every call. Run ``python tests/maxtext/env.py`` to build it
and print its interpreter.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REQUIREMENTS = HERE / "requirements-cpu.txt"
REQUIREMENTS_NODEPS = HERE / "requirements-cpu-nodeps.txt"


class EnvUnavailable(RuntimeError):
    """No Python >= 3.12 to build the MaxText environment with."""


def find_python312() -> str:
    """An interpreter for MaxText: $MTC_MAXTEXT_BASE_PYTHON, python3.12/3.13 on PATH, or pyenv's."""
    cands = [os.environ.get("MTC_MAXTEXT_BASE_PYTHON", "")]
    cands += [shutil.which(n) or "" for n in ("python3.12", "python3.13")]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    cands += sorted(glob.glob(f"{root}/versions/3.12.*/bin/python3.12")) + sorted(
        glob.glob(f"{root}/versions/3.13.*/bin/python3.13"))
    for c in cands:
        if not c:
            continue
        r = subprocess.run([c, "-c", "import sys; print(sys.version_info >= (3, 12))"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == "True":
            return c
    raise EnvUnavailable("no Python >= 3.12 found (MaxText needs one): set MTC_MAXTEXT_BASE_PYTHON to its path "
                         "(with pyenv: $(pyenv root)/versions/3.12.1/bin/python3.12)")


def _key(python: str) -> str:
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True).stdout
    h = hashlib.sha256(REQUIREMENTS.read_bytes() + REQUIREMENTS_NODEPS.read_bytes() + version.encode())
    return h.hexdigest()[:16]


def ensure(log=sys.stderr) -> Path:
    """The MaxText environment's python, built if missing, with this checkout's mtc installed.

    ``$MTC_MAXTEXT_PYTHON`` names an existing environment's python to use instead.
    """
    if os.environ.get("MTC_MAXTEXT_PYTHON"):
        py = Path(os.environ["MTC_MAXTEXT_PYTHON"])
        _install_mtc(py)
        return py
    python = find_python312()
    cache = Path(os.environ.get("MTC_CACHE", os.path.expanduser("~/.cache/mtc")))
    env = cache / f"maxtext-env-{_key(python)}"
    py = env / "bin" / "python"
    env.parent.mkdir(parents=True, exist_ok=True)
    with _locked(env.with_name(env.name + ".lock")):  # test workers (pytest -n) build it once, in turn
        _build(python, env, py, log)
        _install_mtc(py)
    return py


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build(python: str, env: Path, py: Path, log) -> None:
    if not (env / ".complete").exists():
        print(f"building the MaxText environment in {env} (once; a few minutes)", file=log, flush=True)
        shutil.rmtree(env, ignore_errors=True)
        env.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([python, "-m", "venv", str(env)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
                        str(REQUIREMENTS)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-r",
                        str(REQUIREMENTS_NODEPS)], check=True)
        (env / ".complete").write_text(REQUIREMENTS.read_text())


def _install_mtc(py: Path) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "-e", str(REPO)], check=True, capture_output=True)


if __name__ == "__main__":
    print(ensure())
