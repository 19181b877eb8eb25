"""The ramdisk's mount: which filesystem, its page size, the advice, and huge-page ramdisks end to end."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import ramdisk
from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError
from mtc.sidecar.peer import PeerClient, PeerServer
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.unit

MOUNTINFO = "\n".join([
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
    "30 22 0:25 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw,size=8g",
    "31 30 0:26 / /dev/shm/fast rw,relatime shared:3 - tmpfs tmpfs rw,size=4g,huge=within_size",
    r"32 22 0:27 / /mnt/my\040disk rw - tmpfs tmpfs rw,size=1g,huge=always",
    "33 22 0:28 / /local rw - tmpfs tmpfs rw,size=1g",
    "34 22 0:29 / /local rw - tmpfs tmpfs rw,size=1g,huge=advise",  # mounted over the one before
    "this line is not a mount",
])


def test_mountinfo_is_parsed_with_escapes_and_super_options():
    mounts = ramdisk.parse_mountinfo(MOUNTINFO)
    assert [m.mountpoint for m in mounts] == ["/", "/dev/shm", "/dev/shm/fast", "/mnt/my disk", "/local", "/local"]
    assert mounts[2].options["huge"] == "within_size" and mounts[2].options["size"] == "4g"
    assert mounts[1].huge == "never"  # a tmpfs that does not say: the kernel's default
    assert mounts[0].huge == "" and not mounts[0].is_tmpfs


@pytest.mark.parametrize("path, mountpoint, huge", [
    ("/dev/shm/run/mtc", "/dev/shm", "never"),
    ("/dev/shm/fast/run", "/dev/shm/fast", "within_size"),  # the nested mount, not its parent
    ("/dev/shmem", "/", ""),  # a prefix of the name is not a parent directory
    ("/mnt/my disk/x", "/mnt/my disk", "always"),
    ("/local/ckpt", "/local", "advise"),  # stacked on the same point: the later mount is on top
])
def test_the_nearest_mount_holds_the_path(path, mountpoint, huge):
    m = ramdisk.describe(path, MOUNTINFO)
    assert (m.mountpoint, m.huge) == (mountpoint, huge)


def test_advice_names_the_mount_and_the_fix():
    small_pages = ramdisk.advice("/dev/shm/run", MOUNTINFO)
    assert "4 KiB pages" in small_pages and "mount -o remount,huge=within_size /dev/shm" in small_pages
    disk = ramdisk.advice("/var/ckpt", MOUNTINFO)
    assert "not a tmpfs but ext4" in disk and "local_checkpoint_directory" in disk
    assert ramdisk.advice("/dev/shm/fast/run", MOUNTINFO) is None
    assert ramdisk.advice("/mnt/my disk", MOUNTINFO) is None
    assert "(huge=advise)" in ramdisk.advice("/local/ckpt", MOUNTINFO)  # mtc does not madvise
    assert ramdisk.advice("/x", "") is None  # nothing known, nothing said


def test_real_mounts_are_described(tmpfs16, huge_tmpfs):
    assert ramdisk.describe(tmpfs16 / "run").huge == "never"
    assert "remount,huge=within_size" in ramdisk.advice(tmpfs16 / "run")
    m = ramdisk.describe(huge_tmpfs / "run")
    assert m.mountpoint == str(huge_tmpfs) and m.huge == "within_size"
    assert ramdisk.advice(huge_tmpfs) is None


def _shmem_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no ShmemHugePages in /proc/meminfo")


def test_blobs_get_huge_pages_on_a_huge_page_ramdisk(huge_tmpfs):
    store = RamStore(huge_tmpfs / "a")
    before = _shmem_huge_bytes()
    data = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
    name, _ = store.blobs.write(data)
    fd, tmp = store.blobs.open_temp(8 << 20)  # a receive: sized before its first byte
    try:
        assert os.fstat(fd).st_size == 8 << 20 and os.fstat(fd).st_blocks == 0  # sparse: nothing allocated yet
    finally:
        os.close(fd)
        store.blobs.discard_temp(tmp)
    if _shmem_huge_bytes() - before < 8 << 20:  # other processes may free some meanwhile: ask for half
        pytest.fail(f"a 16 MiB blob on {huge_tmpfs} got {(_shmem_huge_bytes() - before) >> 20} MiB of huge pages")
    assert store.blobs.path(name).read_bytes() == data.tobytes()


def test_save_restore_and_peer_fetch_are_bit_for_bit_on_a_huge_page_ramdisk(huge_tmpfs):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(3)
    state = {"w": jax.device_put(random_array(rng, (1024, 1030), np.float32), NamedSharding(mesh, P("x"))),
             "b": jax.device_put(random_array(rng, (8, 3), np.float16), NamedSharding(mesh, P()))}
    cfg = MTCConfig(local_checkpoint_directory=str(huge_tmpfs / "ram"), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1, local_max_to_keep=1)
    with CheckpointManager(cfg) as m:
        for step in range(3):  # later saves overwrite recycled, huge-page blob files
            m.save(step, jax.tree.map(lambda x: x + step, state))
            m.wait_until_finished()
        restored = m.restore()
    assert_trees_bitwise_equal(jax.tree.map(lambda x: x + 2, state), restored)

    # A blob that is not a multiple of 2 MiB crosses from huge pages to small ones at its tail.
    a, b = RamStore(huge_tmpfs / "a"), RamStore(huge_tmpfs / "b")
    data = np.random.default_rng(1).integers(0, 256, (5 << 20) + 12345, dtype=np.uint8)
    name, _ = a.blobs.write(data)
    token = "t" * 32
    with PeerServer(a, token, host_id="a") as srv:
        srv.start()
        with PeerClient(srv.address, token, peer="a") as c:
            assert c.get(b, name, size=data.nbytes) == data.nbytes
    assert b.blobs.path(name).read_bytes() == data.tobytes()


def _serve(store: RamStore):
    srv = PeerServer(store, "t" * 32, host_id="src")
    srv.start()
    return srv


def test_receiving_into_a_map_on_a_huge_page_ramdisk_keeps_every_guarantee(huge_tmpfs, small_huge_tmpfs, ramdisk):
    src = RamStore(ramdisk / "src")  # the sender's ramdisk may have any page size
    dst = RamStore(huge_tmpfs / "dst")
    assert dst.huge_pages and not RamStore(ramdisk / "other").huge_pages
    rng = np.random.default_rng(7)
    good, bad, big = (src.blobs.write(rng.integers(0, 256, n, dtype=np.uint8))[0]
                      for n in ((3 << 20) + 5, 4 << 20, 12 << 20))
    flipped = bytearray(src.blobs.path(bad).read_bytes())
    flipped[(3 << 20) + 17] ^= 0x08  # in the second MiB-sized hash chunk of the map
    src.blobs.path(bad).write_bytes(bytes(flipped))
    with _serve(src) as srv, PeerClient(srv.address, "t" * 32, peer="src") as c:
        assert c.get(dst, good, size=src.blobs.size(good)) == src.blobs.size(good)
        assert dst.blobs.path(good).read_bytes() == src.blobs.path(good).read_bytes()
        with pytest.raises(CorruptBlobError, match="corrupt"):
            c.get(dst, bad, size=len(flipped))
        assert not dst.blobs.has(bad)
        # A ramdisk too small for the blob: a clear error before the map is written (never SIGBUS),
        # no partial file, and this process and the server go on.
        full = RamStore(small_huge_tmpfs / "dst")
        with pytest.raises(InsufficientSpaceError, match="no room for blob|full while receiving blob"):
            c.get(full, big, size=src.blobs.size(big))
        assert c.have([good]) == {good}
    for store in (dst, full):
        assert [p.name for p in (store.root / "blobs").iterdir() if p.name.startswith(".tmp")] == []


def test_a_mapped_receive_cut_short_keeps_nothing(huge_tmpfs, ramdisk):
    """The sender dies halfway through a blob: an error naming the cut, no blob, no temp file."""
    import socket
    import threading

    from mtc.shared import protocol
    from mtc.shared.errors import HostUnreachableError
    from mtc.shared.hashing import blob_name

    data = np.random.default_rng(3).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes()
    name = blob_name(data)
    srv = socket.create_server(("127.0.0.1", 0))

    def half_a_blob() -> None:  # answers one 'get' like a peer server, then dies mid-payload
        conn, _ = srv.accept()
        with conn:
            req = protocol.recv_request(conn, max_payload=0)
            head = protocol.frame_head(protocol.Reply(req.id, {"blob": name, "size": len(data)}).header(), [len(data)])
            conn.sendall(head + data[:len(data) // 2])

    t = threading.Thread(target=half_a_blob)
    t.start()
    dst = RamStore(huge_tmpfs / "dst")
    assert dst.huge_pages
    with PeerClient(f"127.0.0.1:{srv.getsockname()[1]}", "t" * 32, peer="dying") as c:
        with pytest.raises(HostUnreachableError, match="connection closed after 3145728 of 6291456 bytes"):
            c.get(dst, name, size=len(data))
    t.join()
    srv.close()
    assert not dst.blobs.has(name)
    assert list((dst.root / "blobs").iterdir()) == []


def test_a_sidecar_says_once_at_start_what_its_ramdisk_lacks(tmp_path, tmpfs16, huge_tmpfs, caplog):
    import logging

    from mtc.sidecar import service

    if ramdisk.describe(tmp_path) is None or ramdisk.describe(tmp_path).is_tmpfs:
        pytest.skip(f"{tmp_path} is not on a disk here")
    service._advised.clear()
    with caplog.at_level(logging.INFO, logger="mtc.sidecar.service"):
        for root in (tmp_path / "disk" / "a", tmp_path / "disk" / "b", tmpfs16 / "a", huge_tmpfs / "a"):
            service.SidecarService(root, host_id="h").close()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "mtc.sidecar.service"]
    disk = [m for lvl, m in said if "is not a tmpfs" in m and lvl == "WARNING"]
    small = [m for lvl, m in said if "4 KiB pages" in m and lvl == "INFO"]
    assert len(disk) == 1 and len(small) == 1, said  # once per mount, however many sidecars
    assert f"mount -o remount,huge=within_size {tmpfs16}" in small[0]
    assert not any(str(huge_tmpfs) in m for _, m in said)  # a huge-page ramdisk: nothing to say
