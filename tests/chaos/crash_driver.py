"""Driver for the colocated crash tests: save step 1, then die (kill -9) inside step 2's save.

Run as: python crash_driver.py RAMDISK CRASH_POINT
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sh = NamedSharding(Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")), P("a", "b"))
    return {f"w{i}": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32), sh) for i in range(4)}


def main() -> None:
    ramdisk, point = sys.argv[1], sys.argv[2]
    cfg = MTCConfig(local_checkpoint_directory=ramdisk, enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1)
    m = CheckpointManager(cfg)
    m.save(1, state(1))
    m.wait_until_finished()
    os.environ["MTC_CRASH_AT"] = point
    m.save(2, state(2))
    m.wait_until_finished()
    print("survived", flush=True)


if __name__ == "__main__":
    main()
