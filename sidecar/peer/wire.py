"""The peer tier's wire pieces both ends share: limits, the token, sending and receiving a blob."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
from typing import Any

from mtc.shared.errors import (
    CorruptBlobError,
    InsufficientSpaceError,
    ProtocolError,
)
from mtc.shared.hashing import new_hasher
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.mapped import thread_buffer

log = logging.getLogger(__name__)

# Names per "have" request; the header limit below leaves room for them.
HAVE_BATCH = 8192
MAX_PEER_HEADER = 1 << 20
# The largest blob a peer accepts or asks for: one shard. Refuses absurd declared sizes.
MAX_BLOB_BYTES = 1 << 40
# Receive buffer: large enough that syscalls are few, small enough to hash while still in cache.
_RECV_CHUNK = 4 << 20
_HASH_CHUNK = 1 << 20  # hashed while in cache, right after it arrives
_MAP_MIN = 2 << 20  # smaller blobs are received into the buffer: a map's set-up would dominate


class BadCopyError(CorruptBlobError):
    """A peer's copy of a blob arrived whole but does not hash to its name (or has the wrong size)."""


class YieldedCopyError(InsufficientSpaceError):
    """An incoming copy was dropped because a local save needed the room it held; the sender retries later."""


class StalledTransferError(ProtocolError):
    """A blob's bytes stopped arriving for longer than the receive deadline; its partial copy was removed."""


# --- receiving a payload into the ramdisk ------------------------------------------------------


def receive_blob(sock: socket.socket, store: RamStore, name: str, nbytes: int) -> bool:
    """Receive the next ``nbytes`` of ``sock`` as blob ``name`` into ``store``, verified.

    The bytes are hashed as they arrive (one pass over them, not a second one reading the file
    back), and the temp file is published under ``name`` only when the hash matches. On a
    huge-page ramdisk they are received straight into a map of the temp file; otherwise into a
    reused buffer that is then written (see ``_receive_mapped``). Returns whether the blob was
    added (False: it was there already). CorruptBlobError (temp file removed) when the bytes do
    not hash to ``name``: every byte was read, so the connection stays usable. A transport error
    leaves the connection unusable; the temp file is removed either way.

    Local saves come first: a new temp file takes room only as the bytes arrive, and the copy
    is registered with the store (``Arrivals.receiving``), which drops it (shuts its socket
    down) when a local save is short of the room it holds; that raises YieldedCopyError (an
    InsufficientSpaceError), and the sender retries later. StalledTransferError (temp file
    removed) when no byte arrives within the socket's timeout.
    """
    if not store.space.fits([nbytes]):  # checked before a byte is reserved or read, as a save checks its own
        raise InsufficientSpaceError(
            f"ramdisk {store.root} has no room for blob {name} ({nbytes} bytes) from a peer; nothing was "
            "reserved. Size the ramdisk for the peer copies too: see `mtc size`")
    progress = [0]  # bytes received so far, for the messages
    with store.arrivals.receiving(name, lambda: sock.shutdown(socket.SHUT_RDWR)) as arrival:
        # A recycled file of that size if there is one (a save checking its room meanwhile counts it
        # once, in the pool or held by this copy), else a new one, allocated outside that lock.
        fd = store.arrivals.take(arrival, lambda: store.blobs.reuse_temp(nbytes))
        if fd is None:
            fd, arrival.path = store.blobs.new_temp(nbytes)
        tmp = arrival.path
        hasher = new_hasher()
        try:
            try:
                if store.huge_pages and nbytes >= _MAP_MIN:
                    _receive_mapped(sock, fd, nbytes, hasher, name, progress)
                else:
                    _receive_written(sock, fd, nbytes, hasher, name, progress)
            finally:
                os.close(fd)
        except BaseException as e:
            store.blobs.discard_temp(tmp)
            if arrival.yielded:
                raise YieldedCopyError(
                    f"ramdisk {store.root}: dropped the incoming copy of blob {name} after {progress[0]} of "
                    f"{nbytes} bytes, because a local save needed its room (local saves come first); the "
                    "partial copy was removed. The sender retries later") from e
            if isinstance(e, TimeoutError):
                raise StalledTransferError(
                    f"blob {name}: no byte arrived for {sock.gettimeout()} s after {progress[0]} of {nbytes} "
                    "bytes; dropped the transfer and removed the partial copy, its room is free again. The "
                    "sender retries later") from e
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientSpaceError(
                    f"ramdisk {store.root} is full while receiving blob {name} ({nbytes} bytes) from a peer; the "
                    "partial copy was removed. Size the ramdisk for the peer copies too: see `mtc size`") from e
            raise
        actual = hasher.hexdigest()
        if actual != name:
            store.blobs.discard_temp(tmp)
            raise CorruptBlobError(f"received copy of blob {name} is corrupt: its bytes hash to {actual}; discarded")
        return store.blobs.finalize_temp(tmp, name, verify=False)  # verified above, as the bytes arrived


def _cut_short(got: int, nbytes: int, name: str) -> ProtocolError:
    return ProtocolError(f"connection closed after {got} of {nbytes} bytes of blob {name} (peer killed or restarted?)")


def _receive_written(sock: socket.socket, fd: int, nbytes: int, hasher: Any, name: str, progress: list) -> None:
    """recv into this thread's buffer, hash it, write it: for ramdisks with 4 KiB pages.

    A new temp file is sparse (``BlobFiles.open_temp``): the writes allocate its pages as
    the bytes arrive."""
    buf = thread_buffer(_RECV_CHUNK)
    got = 0
    while got < nbytes:
        k = sock.recv_into(buf, min(len(buf), nbytes - got))
        if k == 0:
            raise _cut_short(got, nbytes, name)
        chunk = buf[:k]
        hasher.update(chunk)
        out = 0
        while out < k:
            out += os.write(fd, chunk[out:])
        got += k
        progress[0] = got


def _receive_mapped(sock: socket.socket, fd: int, nbytes: int, hasher: Any, name: str, progress: list) -> None:
    """recv straight into a map of the temp file, hashing each MiB as it lands: one copy, not two.

    With 2 MiB pages a map costs a fault per 2 MiB, and it saves the copy out of a user buffer
    (1 GiB, 2 streams, mapped sender: 0.84-0.89x of a memory-to-memory socket copy against
    0.68-0.80x with recv + write). With 4 KiB pages the faults make it ~4x slower than write(),
    so that path stays. The pages are allocated a chunk (4 MiB) at a time, each once the one
    before is filled: a full ramdisk then fails here with ENOSPC, where writing a sparse map
    would kill the process with SIGBUS, and a copy holds at most 4 MiB more than has arrived.
    """
    if os.fstat(fd).st_size != nbytes:
        os.ftruncate(fd, nbytes)  # sparse: the map needs the size, the chunks allocate the pages
    reserved = nbytes if os.fstat(fd).st_blocks * 512 >= nbytes else 0  # a recycled file: all there
    with mmap.mmap(fd, nbytes) as m, memoryview(m) as view:
        got = hashed = 0
        while got < nbytes:
            if got == reserved:  # what was allocated is filled: allocate the next chunk
                end = min(reserved + _RECV_CHUNK, nbytes)
                os.posix_fallocate(fd, reserved, end - reserved)
                reserved = end
            with view[got:min(got + _RECV_CHUNK, reserved)] as part:
                k = sock.recv_into(part)
            if k == 0:
                raise _cut_short(got, nbytes, name)
            got += k
            progress[0] = got
            while got - hashed >= _HASH_CHUNK or (got == nbytes and hashed < got):
                end = min(hashed + _HASH_CHUNK, got)
                with view[hashed:end] as part:
                    hasher.update(part)  # still in cache: it just arrived
                hashed = end


# --- sending a blob from the ramdisk -----------------------------------------------------------------

_SEND_CHUNK = 4 << 20


def send_blob_file(sock: socket.socket, fd: int, size: int) -> None:
    """Send the ``size`` bytes of open blob file ``fd``: ``sendall`` from a read-only map of it.

    Not ``sendfile``: on loopback and veth (sidecars of one machine, the tests, the benchmark)
    the receiver then copies out of the sender's 4 KiB page-cache fragments, and two streams
    moved 0.55-0.60x of a memory-to-memory copy; from a map the kernel copies once into its own
    large socket buffers, 0.87-0.88x (1 GiB, 2 streams, either page size; ``bench/bench_peer.py``
    measures it). Between hosts that costs the sender one memory copy (~0.1 core-second per GiB).
    The caller pins the blob, so nothing truncates or recycles the file under the map.
    """
    if size == 0:
        return
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m, memoryview(m) as whole:
        for off in range(0, size, _SEND_CHUNK):
            with whole[off:off + _SEND_CHUNK] as part:
                sock.sendall(part)


def peer_failure(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused: peer service not running?"
    if isinstance(e, TimeoutError):
        return "timed out: peer hung or overloaded?"
    if isinstance(e, (ConnectionResetError, BrokenPipeError)):
        return "connection lost: peer killed or restarted?"
    return f"{type(e).__name__}: {e}"
