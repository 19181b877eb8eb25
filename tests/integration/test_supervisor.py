"""The head pod's supervisor (mtc.head.supervisor) with real processes: a training program that saves
and restores with mtc on a real ramdisk folder (tests/integration/supervised_train.py), killed with
SIGKILL, sent SIGTERM, crashing in a loop; every run that finishes is compared with an uninterrupted
one (a digest of the final state, which depends on every step)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("supervised_train.py"))
WARM = "jax,numpy,mtc.head.manager"


class Run:
    """The supervisor around the training program, its events read as they come."""

    def __init__(self, root: Path, steps: int, out: Path, env: dict | None = None, supervised: bool = True):
        environ = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
                       **(env or {}))
        cmd = ([sys.executable, "-m", "mtc.head.supervisor", "--warm", WARM, "--", SCRIPT] if supervised
               else [sys.executable, SCRIPT])
        self.proc = subprocess.Popen([*cmd, str(root), str(steps), str(out)], env=environ, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.events.append(json.loads(line))
                self._cv.notify_all()

    def wait_for(self, pred, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None or any(pred(e) for e in self.events), (
                    f"not seen; events {self.events[-5:]}, stderr {''.join(self.err)[-3000:]}")
                self._cv.wait(min(left, 0.5))

    def finish(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout=timeout)
        time.sleep(0.2)  # the readers drain
        return rc

    def starts(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "start"]

    @property
    def log(self) -> str:
        return "".join(self.err)


def _reference(tmp_path: Path, steps: int) -> str:
    r = Run(tmp_path / "ref-ram", steps, tmp_path / "ref.out", supervised=False)
    assert r.finish() == 0, r.log[-3000:]
    return (tmp_path / "ref.out").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by its parent) is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_training_process_is_replaced_by_the_warm_standby_and_ends_bit_for_bit(ramdisk, tmp_path):
    steps = 12
    want = _reference(tmp_path, steps)
    port = _free_port()
    run = Run(ramdisk / "job", steps, tmp_path / "out", env={"STEP_SLEEP": "0.3", "PORT": str(port)})
    first = run.wait_for(lambda e: e["event"] == "trained" and e["step"] == 4)
    assert "mtc_supervisor_restarts_total{" not in _scrape(port)  # the family, no sample yet
    os.kill(first["pid"], signal.SIGKILL)
    second = run.wait_for(lambda e: e["event"] == "start" and e["pid"] != first["pid"])
    # The standby had imported JAX (and mtc) before it was told to go.
    assert second["restart"] == 1 and second["jax_imported_before_go"], second
    restored = run.wait_for(lambda e: e["event"] == "restored" and e["pid"] == second["pid"])
    assert restored["step"] >= 4
    # The new process serves the dead one's metrics port, with the restart counted by cause.
    run.wait_for(lambda e: e["event"] == "trained" and e["pid"] == second["pid"])
    assert 'mtc_supervisor_restarts_total{cause="SIGKILL"} 1.0' in _scrape(port)
    assert run.finish() == 0, run.log[-3000:]
    assert (tmp_path / "out").read_text() == want
    assert "killed by SIGKILL; restart 1" in run.log and "standby pid" in run.log, run.log[-3000:]
    assert "promoted standby" in run.log


def test_sigterm_goes_to_the_training_process_which_saves_and_exits_0_and_nothing_restarts(ramdisk, tmp_path):
    run = Run(ramdisk / "job", 1000, tmp_path / "out", env={"STEP_SLEEP": "0.2"})
    run.wait_for(lambda e: e["event"] == "trained" and e["step"] == 2)
    time.sleep(1.0)  # the standby is up
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 0, run.log[-3000:]
    pre = [e for e in run.events if e["event"] == "preempted"]
    assert len(pre) == 1 and len(run.starts()) == 1, run.events[-5:]
    assert "passed to the training process" in run.log


def test_a_crash_loop_ends_the_supervisor_non_zero_after_the_bound(ramdisk, tmp_path):
    run = Run(ramdisk / "job", 5, tmp_path / "out", env={"CRASH": "1", "MTC_RESTARTS": "2"})
    assert run.finish() == 3, run.log[-3000:]
    assert len(run.starts()) == 3  # the first start and two restarts
    assert "after 2 restarts within" in run.log and "giving up" in run.log, run.log[-3000:]


def test_bad_input_is_not_restarted(ramdisk, tmp_path):
    run = Run(ramdisk / "job", 5, tmp_path / "out", env={"BAD_INPUT": "1"})
    assert run.finish() == 2 and len(run.starts()) == 1
    assert "bad input" in run.log


def test_without_a_standby_the_training_process_restarts_in_place(ramdisk, tmp_path):
    steps = 8
    want = _reference(tmp_path, steps)
    run = Run(ramdisk / "job", steps, tmp_path / "out", env={"STEP_SLEEP": "0.3", "MTC_STANDBY": "0"})
    first = run.wait_for(lambda e: e["event"] == "trained" and e["step"] == 3)
    os.kill(first["pid"], signal.SIGKILL)
    assert run.finish() == 0, run.log[-3000:]
    assert (tmp_path / "out").read_text() == want
    assert [s["restart"] for s in run.starts()] == [0, 1]
    assert "a new process pid" in run.log and "restarted in place as pid" in run.log and "promoted standby" not in run.log


def test_a_killed_supervisor_takes_its_children_with_it(ramdisk, tmp_path):
    run = Run(ramdisk / "job", 1000, tmp_path / "out", env={"STEP_SLEEP": "0.2"})
    first = run.wait_for(lambda e: e["event"] == "trained" and e["step"] == 1)
    time.sleep(1.0)
    children = [int(p) for p in Path(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children").read_text().split()]
    assert first["pid"] in children and len(children) == 2, children  # the training process and the standby
    run.proc.kill()
    run.finish()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children)


@pytest.mark.parametrize("env,says", [({"MTC_RESTARTS": "many"}, "MTC_RESTARTS='many' is not a number"),
                                      ({"MTC_RESTART_WINDOW_S": "-5"}, "MTC_RESTART_WINDOW_S='-5' is not a number")])
def test_a_bad_setting_is_one_line_naming_it(tmp_path, env, says):
    r = subprocess.run([sys.executable, "-m", "mtc.head.supervisor", "--", SCRIPT, str(tmp_path), "1", "x"],
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sigusr1_asks_the_training_process_for_a_backup_where_it_watches_for_one(ramdisk, tmp_path):
    steps = 12
    want = _reference(tmp_path, steps)
    run = Run(ramdisk / "job", steps, tmp_path / "out", env={"STEP_SLEEP": "0.3", "BACKUP_ROOT": str(tmp_path / "bk")})
    run.wait_for(lambda e: e["event"] == "trained" and e["step"] == 2 and e["backups"] == [1])
    run.proc.send_signal(signal.SIGUSR1)  # an operator, to the pod's supervisor
    asked = run.wait_for(lambda e: e["event"] == "trained" and len(e["backups"]) == 2)
    assert asked["backups"][0] == 1 and asked["backups"][1] >= 3  # the next step after the ask, not step 1000
    assert run.finish() == 0, run.log[-3000:]
    assert (tmp_path / "out").read_text() == want and len(run.starts()) == 1


def test_sigusr1_is_not_passed_to_a_training_process_that_would_die_of_it(ramdisk, tmp_path):
    steps = 8
    want = _reference(tmp_path, steps)
    run = Run(ramdisk / "job", steps, tmp_path / "out", env={"STEP_SLEEP": "0.3"})
    run.wait_for(lambda e: e["event"] == "trained" and e["step"] == 2)
    run.proc.send_signal(signal.SIGUSR1)
    assert run.finish() == 0, run.log[-3000:]
    assert (tmp_path / "out").read_text() == want and len(run.starts()) == 1  # not killed, not restarted
    assert "SIGUSR1 (a backup asked for) not passed on" in run.log
