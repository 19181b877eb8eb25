"""README's Python example runs as written, twice: the second run resumes after the restored step."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (code,) = [b for b in blocks if "CheckpointManager(cfg)" in b]
    return code


def test_readme_example_runs_and_resumes(ramdisk):
    code = _example().replace("/dev/shm/mtc_checkpoints", str(ramdisk))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sh = NamedSharding(mesh, P("x"))

    def init_state():
        return {"w": jax.device_put(jnp.zeros((8, 4), jnp.float32), sh),
                "count": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}

    @jax.jit
    def train_step(state):
        return {"w": state["w"] + 1.0, "count": state["count"] + 1}

    first = {"init_state": init_state, "train_step": train_step, "num_steps": 25}
    exec(compile(code, "README.md", "exec"), first)
    assert int(first["state"]["count"]) == 25 and first["mgr"].last_save_report.step == 20
    second = {"init_state": init_state, "train_step": train_step, "num_steps": 35}
    exec(compile(code, "README.md", "exec"), second)  # restores step 20, trains 21..34
    assert second["mgr"].last_restore_report.step == 20
    assert int(second["state"]["count"]) == 21 + 14 and float(second["state"]["w"][0, 0]) == 35.0


def test_readme_example_with_an_unsharded_scalar_resumes(ramdisk):
    """The trap: the scalar left where optimizer.init() puts it (the default device, uncommitted)
    trains in the first run; restored committed to that device, the second run died inside jit
    ("incompatible devices"). It comes back uncommitted there, and the second run trains on."""
    code = _example().replace("/dev/shm/mtc_checkpoints", str(ramdisk))
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))

    def init_state():
        return {"w": jax.device_put(jnp.zeros((8, 4), jnp.float32), sh), "count": jnp.zeros((), jnp.int32)}

    @jax.jit
    def train_step(state):
        return {"w": state["w"] + 1.0, "count": state["count"] + 1}

    exec(compile(code, "README.md", "exec"), {"init_state": init_state, "train_step": train_step, "num_steps": 25})
    second = {"init_state": init_state, "train_step": train_step, "num_steps": 35}
    exec(compile(code, "README.md", "exec"), second)  # restores step 20, trains 21..34
    assert second["mgr"].last_restore_report.step == 20
    assert int(second["state"]["count"]) == 35 and float(second["state"]["w"][0, 0]) == 35.0


def test_a_restart_after_a_clean_exit_is_not_a_takeover(ramdisk, caplog):
    import logging

    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.device_put(jnp.zeros((8, 4), jnp.float32), sh)}
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)
    with caplog.at_level(logging.INFO, logger="mtc.sidecar.fencing"):
        with CheckpointManager(cfg) as m:
            m.save(1, state)
        with CheckpointManager(cfg) as m:  # after a clean exit: it follows
            m.restore(1)
            m.save(2, state)
        assert "takes over" not in caplog.text and "which closed" in caplog.text, caplog.text
        caplog.clear()
        left_open = CheckpointManager(cfg)  # never closed, as after kill -9
        left_open.save(3, state)
        left_open.wait_until_finished()
        with CheckpointManager(cfg) as m:
            m.restore(3)
        assert "takes over from" in caplog.text and "which did not close" in caplog.text, caplog.text


def test_readme_manifests_render_example_runs_as_written(capsys):
    import shlex

    from mtc.head.tools.cli.main import main

    (line,) = [r for r in README.read_text().splitlines() if r.startswith("| `mtc manifests render")]
    argv = shlex.split(line.split("`")[1])[1:]
    assert main(argv) == 0, capsys.readouterr().err
    assert "kind: JobSet" in capsys.readouterr().out


def test_readme_example_ramdisk_is_a_tmpfs():
    assert "local_checkpoint_directory=/dev/shm/" in _example()  # not /tmp: mtc warns it is not RAM
