"""Restored arrays stay valid after every mtc object is gone and the ramdisk has moved on.

On a CPU backend JAX aliases 64-byte aligned host memory instead of copying it
(``jax.device_put(buf, dev, may_alias=True)``). So a restored array's shards are memory mtc
handed over: in colocated mode, private maps of the blob files (shards of 1 MiB and more); in
cluster mode, the head's receive buffers. Each test establishes which (the address of every
shard, looked up in this process's maps), restores, drops the manager, its dispatcher and
stores, collects garbage, then has a fresh manager on the same ramdisk (the same
``max_to_keep``) save and prune until every blob file of the restored step was collected into
the free pool and written again, or removed. Then it computes with the restored arrays and
compares them bit for bit with copies taken before.

The other process: garbage collection in a second process on the same ramdisk must not
recycle a file this process maps (a restored array would change under its holder).

Run as a script it is that second process (``prune ROOT FIRST LAST``), or runs both checks
(``both ROOT CLUSTER_ROOT CLUSTER_SPEC``: under a malloc checker).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

# Run as a script: the same 8 CPU devices as under pytest (tests/conftest.py), before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402

pytestmark = pytest.mark.integration

MAX_TO_KEEP = 1
PRUNE_STEPS = 4  # saves after the restore: each collects the step before into the pool, the next reuses it


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def make_state(seed: int) -> dict:
    """Shards of 1 MiB and more (mapped by a colocated restore), a replicated one, a small one,
    host numpy; the same sizes for every seed, so that later saves reuse the pool's files."""
    rng = np.random.default_rng(seed)
    m = mesh()
    return {
        "w": jax.device_put(rng.random((2048, 1024), dtype=np.float32), NamedSharding(m, P(None, "model"))),
        "g": jax.device_put(rng.integers(-2**31, 2**31, (2048, 1024), dtype=np.int32),
                            NamedSharding(m, P("data", "model"))),
        "r": jax.device_put(rng.random((512, 1024), dtype=np.float32), NamedSharding(m, P())),
        "small": jax.device_put(rng.random((64, 48), dtype=np.float32), NamedSharding(m, P("data"))),
        "host": rng.integers(0, 2**31, (1024,), dtype=np.int64),
    }


def abstract(state: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if isinstance(v, jax.Array) else v
            for k, v in state.items()}


def colocated_manager(root: Path) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(root), enable_multi_tier_checkpointing=True,
                                       local_checkpoint_period=1, local_max_to_keep=MAX_TO_KEEP))


def cluster_manager(cluster) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root),
                                       cluster_spec=str(cluster.spec_path), local_checkpoint_period=1,
                                       local_max_to_keep=MAX_TO_KEEP))


def prune(manager: CheckpointManager, first: int, last: int) -> None:
    for step in range(first, last + 1):
        manager.save(step, make_state(step))
        manager.wait_until_finished()


# --- where memory lies ---------------------------------------------------------------------


def _maps() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings; path '' for anonymous memory."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5].strip() if len(parts) > 5 else ""))
    return out


def backing(tree: dict) -> dict[str, list[tuple[int, str]]]:
    """leaf -> (address, what the address lies in) of each device shard."""
    maps = _maps()
    out = {}
    for k, v in tree.items():
        if isinstance(v, jax.Array):
            rows = []
            for sh in v.addressable_shards:
                ptr = sh.data.unsafe_buffer_pointer()
                rows.append((ptr, next((p for a, b, p in maps if a <= ptr < b), "?")))
            out[k] = rows
    return out


def files_of(root: Path) -> dict[tuple[int, int], str]:
    """(st_dev, st_ino) -> path of every regular file under ``root``."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with_path = os.path.join(d, n)
            try:
                st = os.lstat(with_path)
            except FileNotFoundError:
                continue
            out[(st.st_dev, st.st_ino)] = with_path
    return out


def blob_files(root: Path) -> dict[tuple[int, int], str]:
    return {k: p for k, p in files_of(root).items()
            if Path(p).parent.name == "blobs" and not Path(p).name.startswith(".")}


# --- the checks ----------------------------------------------------------------------------


def copies(state: dict) -> dict:
    return {k: np.array(v) for k, v in state.items()}  # np.array copies (np.asarray may alias)


_MASK = np.uint32(0x5A5AA5A5)


@jax.jit
def _scramble(tree: dict) -> tuple[dict, dict]:
    """Per leaf: its bits xor a mask (elementwise), and their wrapping sum; both exact."""
    bits = {k: jax.lax.bitcast_convert_type(v, jnp.uint32) ^ _MASK for k, v in tree.items()}
    return bits, {k: jnp.sum(b, dtype=jnp.uint32) for k, b in bits.items()}


def assert_same(restored: dict, expect: dict) -> None:
    """Read through numpy and computed on by XLA: bit for bit the bytes that were saved."""
    for k, want in expect.items():
        same = np.array_equal(np.asarray(restored[k]).view(np.uint8), want.view(np.uint8))
        assert same, f"leaf {k} changed after the restore"
    arrays = {k: v for k, v in restored.items() if isinstance(v, jax.Array)}
    bits, sums = jax.block_until_ready(_scramble(arrays))
    for k, b in bits.items():
        want = expect[k].view(np.uint32) ^ _MASK
        same = np.array_equal(np.asarray(b), want)
        assert same, f"leaf {k}: a computation on it read other bytes than were saved"
        assert int(sums[k]) == int(np.sum(want, dtype=np.uint32)), f"leaf {k}: its sum differs"


def restore_and_drop(make_manager, root: Path) -> tuple[dict, dict, dict]:
    """Save step 1, restore it, drop every mtc object; (restored, copies of the saved, step 1's blob files)."""
    m = make_manager()
    saved = make_state(1)
    expect = copies(saved)
    m.save(1, saved)
    m.wait_until_finished()
    step1 = blob_files(root)
    out = m.restore(1, target=abstract(saved))
    assert_same(out, expect)
    m.close()
    del m, saved
    gc.collect()
    return out, expect, step1


def assert_step_collected(root: Path, step1: dict) -> None:
    """Every blob file of step 1 is gone from its name: unlinked, or in the free pool or reused."""
    names = set(blob_files(root).values())
    left = sorted(p for p in step1.values() if p in names)
    assert not left, (f"the later saves did not collect step 1's blobs (still there: {left[:3]}): "
                      "this test checks nothing")


def check_colocated(root: Path, other_process: bool) -> None:
    out, expect, step1 = restore_and_drop(lambda: colocated_manager(root), root)
    where = backing(out)
    mapped = {p for rows in where.values() for _, p in rows if p.startswith(str(root))}
    # The shards of 1 MiB and more are the blob files' maps (JAX did not copy them); the small
    # shard is in anonymous memory the sidecar read it into.
    assert {p for _, p in where["w"]} <= mapped and len(where["w"]) == 8, where["w"]
    assert len({a for a, _ in where["r"]}) == 1, "one map of the replicated blob for all 8 devices"
    assert not any(p.startswith(str(root)) for _, p in where["small"]), where["small"]
    assert all(os.path.basename(p) in {os.path.basename(q) for q in step1.values()} for p in mapped), mapped
    if other_process:
        env = dict(os.environ)
        env.pop("MALLOC_PERTURB_", None)
        r = subprocess.run([sys.executable, __file__, "prune", str(root), "2", str(1 + PRUNE_STEPS)],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    else:
        m = colocated_manager(root)
        prune(m, 2, 1 + PRUNE_STEPS)
        m.close()
        del m
        gc.collect()
    assert_step_collected(root, step1)
    # The maps' files are unlinked: one that lives on under another name was recycled (a file
    # recycled, rewritten and removed again shows as unlinked too: the bytes below tell).
    now = backing(out)
    for rows in now.values():
        for _, p in rows:
            if p.startswith(str(root)):
                assert p.endswith("(deleted)"), f"a restored shard maps {p}, a file that lives on under another name"
    assert_same(out, expect)


def check_cluster(cluster) -> None:
    out, expect, step1 = restore_and_drop(lambda: cluster_manager(cluster), cluster.root)
    where = backing(out)
    # The head's receive buffers: anonymous memory or the heap (no file), one buffer per box,
    # aliased by every device that holds the box (JAX did not copy them).
    for k, rows in where.items():
        assert all(p in ("", "[heap]") for _, p in rows), (k, rows)
    assert len({a for a, _ in where["r"]}) == 1, where["r"]
    assert len({a for a, _ in where["w"]}) == 4, where["w"]  # 4 boxes, each on 2 devices
    m = cluster_manager(cluster)
    prune(m, 2, 1 + PRUNE_STEPS)
    m.close()
    del m
    gc.collect()
    assert_step_collected(cluster.root, step1)
    reused = set(step1) & set(blob_files(cluster.root))  # the same file under another blob's name
    assert reused, "no file of step 1 went through the free pool into a later step: this test checks less"
    assert_same(out, expect)


def test_colocated_restore_outlives_its_store_and_later_saves(ramdisk):
    check_colocated(ramdisk, other_process=False)


def test_colocated_restore_outlives_saves_of_another_process(ramdisk):
    check_colocated(ramdisk, other_process=True)


def test_past_the_descriptor_budget_blobs_are_read_instead_of_mapped(ramdisk, monkeypatch):
    """Each map holds a descriptor (its lock): past the budget the restore reads, and the arrays
    outlive the later saves as well."""
    from mtc.sidecar.ram import readers

    gc.collect()
    before = len(readers._lock_fds)  # maps of earlier tests' arrays still alive, if any
    monkeypatch.setattr(readers, "max_locked_maps", lambda: before + 4)
    out, expect, step1 = restore_and_drop(lambda: colocated_manager(ramdisk), ramdisk)
    where = backing(out)
    mapped = {a for rows in where.values() for a, p in rows if p.startswith(str(ramdisk))}
    assert 1 <= len(mapped) <= 4, where
    assert sum(p in ("", "[heap]") for rows in where.values() for _, p in rows) > 8, where
    assert len(readers._lock_fds) - before == len(mapped)
    with colocated_manager(ramdisk) as m:
        prune(m, 2, 1 + PRUNE_STEPS)
    assert_step_collected(ramdisk, step1)
    assert_same(out, expect)


def test_cluster_restore_outlives_its_dispatcher_and_later_saves(local_cluster):
    check_cluster(local_cluster)


def test_under_a_malloc_checker(ramdisk, local_cluster):
    """Both modes again in a process with glibc's malloc checker and freed memory overwritten
    (a receive buffer freed under an array would then read back as the perturb byte)."""
    env = dict(os.environ, MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    debug = next((p for p in ("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/usr/lib64/libc_malloc_debug.so.0")
                  if os.path.exists(p)), None)
    if debug:  # glibc >= 2.34 checks only with its debug library preloaded
        env["LD_PRELOAD"] = ":".join(x for x in (debug, env.get("LD_PRELOAD")) if x)
    r = subprocess.run([sys.executable, __file__, "both", str(ramdisk / "colocated"), str(local_cluster.root),
                        str(local_cluster.spec_path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "colocated: restored arrays intact" in r.stdout and "cluster: restored arrays intact" in r.stdout


if __name__ == "__main__":
    import types

    what, root = sys.argv[1], Path(sys.argv[2])
    if what == "prune":
        with colocated_manager(root) as manager:
            prune(manager, int(sys.argv[3]), int(sys.argv[4]))
    elif what == "both":
        root.mkdir()
        check_colocated(root, other_process=False)
        print("colocated: restored arrays intact", flush=True)
        check_cluster(types.SimpleNamespace(root=Path(sys.argv[3]), spec_path=Path(sys.argv[4])))
        print("cluster: restored arrays intact")
