"""Held-out samples: the keys training leaves out, and the keys evaluation scores.

A held-out split lives in the same shards as the training data: training drops its keys from
every batch (:class:`HeldOutKeys`, ``--model.exclude_keys FILE``) and the checkpoint records
them, so that evaluation scores exactly those (:func:`eval_keys`), whatever the file holds later.
Without recorded or given keys evaluation falls back to a deterministic index split
(:func:`heldout_split`), labelled unchecked.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Optional

from eagle_train.vocab import read_key_list

log = logging.getLogger(__name__)

#: the index split's share of the keys when neither keys nor a fraction are given and the checkpoint records none
DEFAULT_HELDOUT_FRACTION = 0.1


class HeldOutKeys:
    """The sample keys training leaves out of its batches (``exclude_keys``: a JSON list file;
    None: none), and the ones a checkpoint records (:attr:`recorded`, sorted; None for a
    checkpoint written before they were recorded)."""

    def __init__(self, path: Optional[str] = None):
        self.path = path
        self.keys: set[str] = set(read_key_list(path, "exclude_keys")) if path else set()
        self.recorded: Optional[list[str]] = sorted(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def restore(self, recorded: Optional[list[str]]) -> None:
        """Take the keys a checkpoint records (None: it records none; the given file's stay in force).

        Raises:
            ValueError: keys were given (a resumed training) that differ from the recorded ones:
                the samples trained on so far would not be the ones held out."""
        if self.path and recorded is not None and sorted(recorded) != sorted(self.keys):
            raise ValueError(f"exclude_keys {self.path} holds {len(self.keys)} key(s), the checkpoint's training "
                             f"left out {len(recorded)} others: a resumed run keeps the held-out keys it started "
                             "with (leave exclude_keys out, or give the same file); start a new run to hold out "
                             "other keys")
        self.recorded = recorded
        if recorded is not None:
            self.keys = set(recorded)


def heldout_split(dataset_dir: str | Path, fraction: float = 0.1, seed: int = 0, min_count: int = 1) -> list[str]:
    """Deterministic index split: keys ranked by ``sha256(f"{seed}:{key}")``, the first
    ``max(min_count, round(fraction * n))`` are held out. Returned sorted."""
    from eagle_data.stream.index import load_index

    keys = list(load_index(dataset_dir)["key"])
    n = max(min_count, round(fraction * len(keys)))
    ranked = sorted(keys, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())
    return sorted(ranked[:n])


def keys_in(dataset_dir: str | Path, keys: list[str], source: str) -> list[str]:
    """The held-out ``keys`` that ``dataset_dir`` holds (a key list may span several training
    folders: the others are logged, not an error).

    Raises:
        ValueError: keys were given but the folder holds none of them, naming where they came from
            (e.g. the checkpoint's held-out keys of its training folder, given another folder).
    """
    from eagle_data.stream.index import load_index

    held = set(load_index(dataset_dir)["key"])
    present = [k for k in keys if k in held]
    if keys and not present:
        raise ValueError(f"{dataset_dir}: none of the {len(keys)} held-out keys from {source} is in this dataset "
                         f"(e.g. {sorted(keys)[:3]}): evaluate the dataset they were split from, or give "
                         "--heldout_keys FILE listing the keys to score, or --heldout_fraction 1.0 for a set "
                         "extracted apart from the training data")
    if len(present) < len(keys):
        log.warning("eval: %d of the %d held-out keys from %s are not in %s (other folders, or misspelt): "
                    "%d evaluated at most", len(keys) - len(present), len(keys), source, dataset_dir, len(present))
    return present


def eval_keys(dataset_dir: str, recorded: Optional[list[str]], heldout_keys: Optional[str] = None,
              heldout_fraction: Optional[float] = None) -> tuple[list[str], str]:
    """The held-out keys to score in ``dataset_dir`` and where they come from: ``heldout_keys``
    (a JSON list file), else an index split of ``heldout_fraction`` when it is given, else the
    keys a checkpoint records as left out of its training (``recorded``; None: no checkpoint),
    else an index split of :data:`DEFAULT_HELDOUT_FRACTION`. An index split of a checkpoint's
    data is warned about (nothing says the drafter did not train on it), and so are given keys
    the checkpoint does not record as left out.

    Raises:
        ValueError: an empty path, both keys and a fraction, or keys the folder does not hold."""
    if heldout_keys == "":
        raise ValueError("heldout_keys: an empty path (give a JSON file of keys, or leave it out)")
    if heldout_keys and heldout_fraction is not None:
        raise ValueError("give heldout_keys or heldout_fraction, not both (the keys name the held-out samples)")
    if heldout_keys is None and recorded and heldout_fraction is None:
        return keys_in(dataset_dir, recorded, "the checkpoint"), "the checkpoint's held-out keys"
    if heldout_keys:
        keys = keys_in(dataset_dir, read_key_list(heldout_keys, "heldout_keys"), f"heldout_keys ({heldout_keys})")
        outside = len(set(keys) - set(recorded)) if recorded is not None else 0
        if outside:
            log.warning("eval: %d of the %d held-out keys given were not left out of this drafter's training (its "
                        "checkpoint records %d left out): if it trained on those samples, tau is overstated",
                        outside, len(keys), len(recorded))
        return keys, "heldout_keys"
    if recorded is not None:
        why = (f"heldout_fraction given: the {len(recorded)} held-out keys the checkpoint records are not used"
               if recorded else "no held-out keys (none given, none recorded by the checkpoint: train with "
               "--model.exclude_keys FILE)")
        log.warning("eval: %s: an index split of %s is evaluated, unchecked against the training data. If the "
                    "drafter trained on it, tau is overstated; a set extracted apart from the training data is fine",
                    why, dataset_dir)
    fraction = DEFAULT_HELDOUT_FRACTION if heldout_fraction is None else heldout_fraction
    return heldout_split(dataset_dir, fraction), "index split (not checked against the training data)"
