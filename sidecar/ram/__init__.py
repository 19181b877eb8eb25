"""The RAM tier: one host's content-addressed blob store and committed steps on its ramdisk.

``RamStore`` (``store``) makes the parts and hands each its collaborators; callers use the parts
as its attributes: ``blobs`` (``BlobFiles``: write, publish, read verified, map), ``catalog``
(``StepCatalog`` of ``steps``: pending host manifests and commits), ``landings`` (``Landings`` of
``ledger``: the store's open landings, over ``mapped``: mapped temp blob files that a save's copy
lands in, one copy per save; ``Arrivals``: the peer copies being received), ``space`` (``StoreSpace``: what fits,
retention, garbage collection; ``Pins``: names kept from it). Beside them: ``pool`` (the free
pool), ``readers`` (which files this process reads or maps), ``common`` (names, limits).

Layout under ``root`` (= ``<local_checkpoint_directory>/mtc``)::

    blobs/<32-hex>                committed blobs: raw bytes, named by their xxh3-128
    blobs/.tmp-<random>           blob writes in progress (never look like committed data)
    blobs/.tmp-free-<random>      the free pool: collected blob files kept for reuse
    pending/<step:012d>/host.json phase-1 host manifest (keeps its blobs alive until commit)
    steps/<step:012d>.json        the commit: the step manifest, written last, atomically

A step is committed iff ``steps/<step>.json`` exists and parses as JSON whose ``"step"``
equals the number in the file name. Nothing else makes a step visible.

Concurrency: blob writes (``BlobFiles.write``, ``finalize_temp``, ``put_file``) may run
from several threads at once. Metadata operations (``RamStore.commit``, ``write_pending``,
``delete_step``, ``wipe``; ``StoreSpace.prune``, ``gc``, ``check_space``) are serialised by the
store's one lock. Garbage collection spares blobs referenced by a kept step, by a pending host
manifest, or pinned with :meth:`Pins.hold` (``store.pins``); a caller that writes blobs while another thread may commit
(and so collect) pins the names first, until its host manifest is written. One process owns
a root at a time (opening a store removes leftover temp files).

Free pool: garbage collection renames collected blob files to ``blobs/.tmp-free-*`` instead
of unlinking them (up to the bytes of the newest step), and ``BlobFiles.write`` overwrites a pool
file of exactly the blob's size, then publishes it like a new file. On tmpfs, overwriting
pages that exist is ~2x faster than first-touch writes, and the unlink (freeing the pages)
leaves the commit's critical path. Pool files are temp files: never visible as blobs, removed
when a store opens, counted as reclaimable by ``check_space`` and ``usage``.
A file is never recycled while any process reads or maps it (``BlobFiles.read_into``,
``map``, ``verify`` register it by inode for this process's collection and hold a shared
``flock`` for other processes'; collection unlinks such a file instead), so a restored array that
maps a blob never changes. Code that opens blob files itself (uploads,
peer sends) must keep the names pinned while the file is open.
"""

from mtc.sidecar.ram.common import FREE_PREFIX, TMP_PREFIX, format_binary_bytes
from mtc.sidecar.ram.readers import in_use
from mtc.sidecar.ram.store import RamStore

__all__ = ["RamStore", "format_binary_bytes", "in_use", "TMP_PREFIX", "FREE_PREFIX"]
