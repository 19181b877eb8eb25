"""MaxText's data iterator in mtc's steps: which iterators, under which names, from which pipeline.

MaxText's standard checkpoints keep a Grain iterator's position as the ``iter`` item beside the
state (``maxtext.common.grain_utility``); its emergency/replicator path keeps only the state.
Under the launcher every mtc step of a Grain run holds ``iter`` too (``mtc.head.items``), named
as MaxText's standard path names the files, so that the same rules decide what a resized run
can restore:

- one head process (Pathways' single controller, mtc's cluster mode) with one iterator: its
  position is global, so a run with fewer or more devices (a lost slice, a larger global batch)
  resumes at the next record, none repeated or skipped;
- ``expansion_factor_real_data`` or a list of iterators: the number of data-loading shards must
  fit the saved one as MaxText requires; otherwise the restore is refused, saying so;
- Grain's ``ElasticIterator``: one global position (``process_0.json``), restorable onto any size.

The pipeline's description (data files, shuffling, workers, sequence length) is saved with the
position and compared at restore: a position is never applied to data it does not belong to.
``MTC_DATA_RESTART=1`` restores the state without the position (the data starts over), on purpose.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

from mtc.head.items import DataPositionError, IteratorRestore, IteratorSave

log = logging.getLogger(__name__)

ITEM = "iter"  # the item's name, as MaxText's standard checkpoints call it

# MaxText settings whose change makes a saved position point at other data (the global batch
# size is not one: the position counts records).
PIPELINE_FLAGS = ("dataset_type", "grain_file_type", "grain_train_mixture_config_path", "enable_data_shuffling",
                  "data_shuffle_seed", "grain_worker_count", "grain_num_threads", "max_target_length", "packing",
                  "num_epoch")


def restart_requested(environ: Any = None) -> bool:
    from mtc.shared.config import env_flag

    return env_flag("MTC_DATA_RESTART", os.environ if environ is None else environ, default=False)


def _files(pattern: str) -> list[str]:
    """The data files' names (not their directories: a copy of the data elsewhere is the same data)."""
    names = []
    for part in str(pattern).replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        local = not part.startswith(("gs://", "hf://", "s3://")) and any(c in part for c in "*?[")
        found = sorted(glob.glob(part, recursive=True)) if local else []
        names += [os.path.basename(f) for f in found] or [os.path.basename(part.split(",")[0])]
    return names


def pipeline_of(config: Any) -> dict:
    """What the position belongs to: the data files and the settings that shape the stream."""
    out = {k: getattr(config, k) for k in PIPELINE_FLAGS if hasattr(config, k)}
    out = {k: (v if isinstance(v, (bool, int, float, str)) or v is None else str(v)) for k, v in out.items()}
    out["grain_train_files"] = _files(getattr(config, "grain_train_files", "") or "")
    return out


def _local(it: Any) -> Any:
    return getattr(it, "local_iterator", it)


def _remote(it: Any) -> bool:
    """MaxText's RemoteIteratorWrapper (Pathways colocated data loading): it keeps its own state."""
    return callable(getattr(it, "save_state", None)) and callable(getattr(it, "restore_state", None))


def _elastic(it: Any) -> bool:
    try:
        from grain.experimental import ElasticIterator
    except ImportError:
        return False
    return isinstance(_local(it), ElasticIterator)


def describe_skip(config: Any, data_iterator: Any) -> str | None:
    """The one line a run logs at start when mtc does not keep its data position (None: it does)."""
    dataset = getattr(config, "dataset_type", None)
    if dataset != "grain":
        return (f"mtc: dataset_type={dataset}: the data position is not saved with mtc's steps (only Grain's iterator "
                "is checkpointable); a resumed run reads its data from the start (synthetic data: the same batches). "
                "Use dataset_type=grain for an exact resume")
    if data_iterator is None or type(data_iterator).__name__ == "PlaceHolderDataIterator":
        return "mtc: this process loads no data (a placeholder iterator): there is no data position to save"
    if _remote(data_iterator):
        return ("mtc: the data iterator is MaxText's colocated RemoteIteratorWrapper: it keeps its own position "
                "(saved and restored by it, keyed by step), not in mtc's tiers")
    return None


def keeps_position(config: Any, data_iterator: Any) -> bool:
    return describe_skip(config, data_iterator) is None


def _save_layout(data_iterator: Any, expansion: int) -> tuple[list[Any], list[str]]:
    """(iterators, file names) as MaxText's ``grain_utility.for_save`` names them."""
    import jax

    if not isinstance(data_iterator, list) and _elastic(data_iterator):
        return [_local(data_iterator)], ["process_0.json"]
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    index, count = jax.process_index(), jax.process_count()
    total = count * len(iterators)
    if expansion > 1:
        total //= expansion
    if len(iterators) == 1 and total == count:
        return [_local(iterators[0])], [f"process_{index}-of-{count}.json"]
    return [_local(it) for it in iterators], [f"process_{index + i * count}-of-{total}.json"
                                              for i in range(len(iterators))]


def save_args(config: Any, data_iterator: Any) -> IteratorSave:
    iterators, names = _save_layout(data_iterator, int(getattr(config, "expansion_factor_real_data", -1) or -1))
    return IteratorSave(iterators, names=names, pipeline=pipeline_of(config))


def restore_args(config: Any, data_iterator: Any) -> IteratorRestore:
    """The iterator item's restore, with MaxText's rules for a changed number of data shards."""
    import jax

    expansion = int(getattr(config, "expansion_factor_real_data", -1) or -1)
    index, count = jax.process_index(), jax.process_count()
    is_list = isinstance(data_iterator, list)
    elastic = not is_list and _elastic(data_iterator)
    iterators = [_local(it) for it in data_iterator] if is_list else [_local(data_iterator)]

    def names(saved: list[str]) -> list[str]:
        if elastic:
            return ["process_0.json"]
        stored = len([n for n in saved if n.startswith("process_") and "-of-" in n])
        if stored > count and is_list and stored == count * len(iterators):
            return [f"process_{index + i * count}-of-{stored}.json" for i in range(len(iterators))]
        if stored == count and not is_list:
            return [f"process_{index}-of-{count}.json"]
        if expansion > 1 and stored == count // expansion and not is_list:
            return [f"process_{index}-of-{stored}.json"]
        raise DataPositionError(
            f"the step's data position was saved by {stored} data-loading shard(s) ({', '.join(saved)}) and this run "
            f"loads {len(iterators)} iterator(s) in {count} process(es) (expansion_factor_real_data={expansion}): "
            "MaxText cannot map one onto the other. Set expansion_factor_real_data so that the data shards match the "
            "saved ones, or restart the data on purpose with MTC_DATA_RESTART=1")

    return IteratorRestore(iterators if is_list else iterators[0], names=names, pipeline=pipeline_of(config))
