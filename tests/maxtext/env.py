"""The Python environment the MaxText tests and benchmark run MaxText in (built once, reused).

MaxText needs Python >= 3.12 and its train loop's dependencies; the project's own venv may be
3.11. ``ensure()`` builds a virtualenv from ``requirements-cpu.txt`` (the smallest set found
to run MaxText's CPU train loop) outside the repository, under ``$MTC_CACHE`` (default
``~/.cache/mtc``), named by a hash of what it is built from. One environment serves every
checkout on the machine (a clone in CI, worktrees side by side): ``ensure()`` sets
``MTC_CHECKOUT`` to this checkout in the environment of the calling process, which its
children inherit, and a path hook in the MaxText environment (``_mtc_checkout.py``, loaded by a
``.pth`` file) imports ``mtc`` from the checkout that names. Without ``MTC_CHECKOUT`` the
environment imports the checkout that built it (an editable install). Run
``python tests/maxtext/env.py`` to build it and print its interpreter.
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
    os.environ["MTC_CHECKOUT"] = str(REPO)  # what this process's MaxText children import as mtc
    if os.environ.get("MTC_MAXTEXT_PYTHON"):
        py = Path(os.environ["MTC_MAXTEXT_PYTHON"])
        with _locked(py.parent.parent / ".mtc-checkout.lock"):
            _link_checkouts(py)
        return py
    python = find_python312()
    cache = Path(os.environ.get("MTC_CACHE", os.path.expanduser("~/.cache/mtc")))
    env = cache / f"maxtext-env-{_key(python)}"
    py = env / "bin" / "python"
    env.parent.mkdir(parents=True, exist_ok=True)
    with _locked(env.with_name(env.name + ".lock")):  # test workers (pytest -n) build it once, in turn
        _build(python, env, py, log)
        _link_checkouts(py)
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


# Imports mtc.head, mtc.sidecar and mtc.shared from the folders of the checkout $MTC_CHECKOUT names
# (the project maps each package to a folder of its own: pyproject's package-dir).
_HOOK = """import importlib.machinery, importlib.util, os, sys

_FOLDERS = {"mtc.head": "head", "mtc.sidecar": "sidecar", "mtc.shared": "shared"}


class CheckoutFinder:
    def __init__(self, root):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name == "mtc":
            spec = importlib.machinery.ModuleSpec("mtc", None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        folder = _FOLDERS.get(name)
        if folder is None:
            return None
        where = os.path.join(self.root, folder)
        return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])


if os.environ.get("MTC_CHECKOUT"):
    sys.meta_path.insert(0, CheckoutFinder(os.environ["MTC_CHECKOUT"]))
"""


def _link_checkouts(py: Path) -> None:
    """The path hook (every checkout, by ``MTC_CHECKOUT``), and once an editable install of this one."""
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    hook = site / "_mtc_checkout.py"
    if not hook.exists() or hook.read_text() != _HOOK:
        hook.write_text(_HOOK)
        (site / "_mtc_checkout.pth").write_text("import _mtc_checkout\n")
    if not list(site.glob("__editable__*mtc*")):
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", "-e", str(REPO)], check=True, capture_output=True)


if __name__ == "__main__":
    print(ensure())
