"""Streaming EAGLE-3 batches from eagle-data WebDataset shards, exact-once under DDP x workers.

Pipeline (webdataset stages; each worker runs it on its own slot, see :mod:`eagle_data.stream.shards`)::

    shard list (manifests) -> (seed, epoch) permutation -> split by node -> split by worker
    -> tar (:class:`eagle_data.format.tar.TarWalk`, webdataset member/key semantics, per span;
       local files: member descriptors + kernel readahead) -> shuffle (webdataset's bufsize/initial schedule)
    -> batch plan -> decode (safetensors header checks, no pickle; hidden states stay in the
       file or are views) + truncate -> pad/collate (one copy per sample: ``preadv`` or a
       memory copy straight into the batch, in ``read_threads`` threads; shared memory in
       workers, a reused buffer pool otherwise)

Use it through :class:`eagle_data.stream.loader.EagleDataLoader` (epochs, resume, skip counts) or
:class:`eagle_data.stream.datamodule.EagleDataModule`; the settings of every stage are one
:class:`~eagle_data.stream.config.ReadConfig`. See :mod:`eagle_data.stream.plan` for the
equal-batch-count rule.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
from collections import Counter
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from eagle_data.stream import plan as B
from eagle_data.stream import collate as C
from eagle_data.format.fp8 import dequantize_fields
from eagle_data.format.schema import STORAGE_DTYPES, SampleError, batch_dtype, decode_tensors
from eagle_data.format.layout import INDEX_NAME
from eagle_data.stream.shards import (check_compat, epoch_shard_order, manifest_fact, resolve_sources, slot_sizes,
                                      slot_spans)
from eagle_data.format.final_rows import expand as expand_final_rows
from eagle_data.format.payload import view_tensors
from eagle_data.stream.config import ReadConfig
from eagle_data.stream.reader import read_span

log = logging.getLogger(__name__)


#: the key of the one item a DataLoader worker yields for a data error (see :meth:`EagleShardDataset.__iter__`)
WORKER_ERROR = "__eagle_data_error__"


class EagleShardDataset(IterableDataset):
    """Padded EAGLE-3 batches from eagle-data shards; every sample exactly once per epoch
    across ``world_size`` ranks x ``num_workers`` workers, equal batch counts on all ranks.

    Each item is a :class:`~eagle_data.stream.collate.Batch` (``skipped`` only with
    ``on_error="skip"``; :class:`~eagle_data.stream.loader.EagleDataLoader` takes it out).

    Args:
        sources: dataset dir(s)/URL(s) with ``manifest.json``, manifest file(s), or shard
            URLs / brace patterns (``s3://``, ``gs://``, ``https://``, ``pipe:``...).
        read: how to read (:class:`~eagle_data.stream.config.ReadConfig`: batching, shuffling,
            expected model facts, error policy; a dict of its fields is taken too; None: the
            defaults). ``batch_size`` or ``max_tokens`` must be given here or in ``fields`` unless
            ``read`` is a ``ReadConfig`` (both: the token budget wins).
        manifest: manifest for shard-URL sources (default: the one next to each shard).
        rank, world_size: override ``torch.distributed`` (simulation, tests).
        **fields: :class:`~eagle_data.stream.config.ReadConfig` fields, over ``read``'s
            (``EagleShardDataset(path, max_tokens=16384)``).

    Raises:
        ValueError: bad read settings or no batching given (see
            :class:`~eagle_data.stream.config.ReadConfig`), missing/incompatible manifests, fewer
            samples than slots.
        TypeError: a keyword that is no ``ReadConfig`` field.
    """

    def __init__(self, sources: str | Sequence[str], read: ReadConfig | dict[str, Any] | None = None, *,
                 manifest: str | None = None, rank: int | None = None, world_size: int | None = None,
                 **fields: Any):
        self.read = read = ReadConfig.of(read, **fields)
        self.shards, manifests = resolve_sources(sources, manifest)
        self.facts = check_compat(manifests, {"hidden_size": read.hidden_size, "aux_layer_ids": read.aux_layer_ids,
                                              "dtype": read.dtype})
        self.manifests = [u for u, _ in manifests]
        #: each manifest's ``weights_fingerprint`` (None: not recorded): which weights made its states
        self.fingerprints = {u: manifest_fact(m, "weights_fingerprint") for u, m in manifests}
        #: samples per batch in fixed mode, None in token mode (``read.max_tokens``)
        self.batch_size = read.fixed_batch_size
        self.rank, self.world_size = rank, world_size
        #: threads reading samples into a batch (``read.read_threads``, resolved)
        self.read_threads = read.read_threads or min(4, os.cpu_count() or 1)
        self._warned_drop = False
        self._pool = C.BufferPool()  # batch memory reused in this process (not in workers: shared memory)
        self.num_samples = sum(s.num_samples for s in self.shards)
        self.hidden_size = int(self.facts["hidden_size"])
        self.aux_width = len(self.facts["aux_layer_ids"]) * self.hidden_size
        #: stored dtypes of the aux and final states (the manifest's); batches hold ``self.dtype``
        #: (fp8 dequantised to bfloat16; one dtype for both fields: theirs when equal, else float32)
        self.stored = {"aux_hidden_states": STORAGE_DTYPES[self.facts["dtype"]],
                       "hidden_states": STORAGE_DTYPES[self.facts["final_dtype"]]}
        both = {batch_dtype(d) for d in self.stored.values()}
        self.dtype = both.pop() if len(both) == 1 else torch.float32
        self.epoch = 0
        self.num_workers = 1      # see set_topology (used by __len__; workers read get_worker_info)
        self.skip_batches = 0     # rank-level batches of ``epoch`` already consumed (resume)
        # shared [epoch, skip]: persistent DataLoader workers (any DataLoader, not only ours) hold their own
        # copy of this object and read the epoch set in the main process here at every epoch's start
        self._epoch_cell = torch.tensor([0, 0], dtype=torch.int64).share_memory_()
        self.skipped: Counter = Counter()

    @property
    def max_length(self) -> int | None:
        """``read.max_length``: samples are cut to this many tokens (None: as stored)."""
        return self.read.max_length

    @property
    def max_tokens(self) -> int | None:
        """``read.max_tokens``: the token budget per batch (None: fixed ``batch_size``)."""
        return self.read.max_tokens

    # ---- topology and plan ------------------------------------------------------------------
    def plan_facts(self) -> dict[str, Any]:
        """What the epoch plan depends on besides seed, epoch and topology: the batching and
        shuffling settings and the shards (names and counts, in order; not where they live). A
        resume must find them equal (:meth:`~eagle_data.stream.loader.EagleDataLoader.load_state_dict`)."""
        shards = hashlib.sha256(json.dumps([(s.name, s.num_samples, s.num_tokens) for s in self.shards]).encode())
        r = self.read
        return {"batch_size": self.batch_size, "max_tokens": r.max_tokens, "max_length": r.max_length,
                "max_batch_size": r.max_batch_size, "bucket_window": r.bucket_window, "shuffle": r.shuffle,
                "shuffle_buffer": r.shuffle_buffer, "shuffle_initial": r.shuffle_initial,
                "shards": shards.hexdigest()[:16]}

    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)``: constructor args, else ``torch.distributed``, else ``(0, 1)``."""
        if self.world_size is not None:
            return self.rank or 0, self.world_size
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def set_topology(self, num_workers: int | None = None, freeze_rank: bool = False) -> None:
        """Declare how this dataset is read: ``num_workers`` DataLoader workers (0 counts as 1;
        :meth:`__len__` depends on it); ``freeze_rank`` fixes ``(rank, world_size)`` from
        :meth:`rank_world` now (in the main process: workers may not see ``torch.distributed``)."""
        if num_workers is not None:
            self.num_workers = max(1, num_workers)
        if freeze_rank:
            self.rank, self.world_size = self.rank_world()

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch (order = f(seed, epoch)) and how many of this rank's batches to skip.

        Also written to a shared-memory cell that persistent DataLoader workers (forked once,
        holding their own copy of this object) read at the start of every epoch."""
        self.epoch, self.skip_batches = epoch, skip_batches
        self._epoch_cell[0], self._epoch_cell[1] = epoch, skip_batches

    def _sizes(self, world: int, workers: int) -> tuple[list[int], list[list[int]] | None]:
        """``(samples per slot, batch sizes per slot)`` in slot order (rank-major); the batch sizes
        only in fixed mode, where they are planned per rank and dealt to its workers
        (:func:`eagle_data.stream.plan.rank_fixed_sizes`), so they do not depend on ``workers``.
        Token mode reads whole rank parts (:meth:`plan`): one slot per rank."""
        n = self.num_samples
        if n < world:
            raise ValueError(f"{n} samples cannot feed {world} ranks")
        if self.batch_size is None:  # token mode: ranks get n // world or one more
            return slot_sizes(n, world), None
        if self.batch_size == 1 and n % world and not self._warned_drop:
            self._warned_drop = True
            log.warning("batch_size=1: dropping the last %d positions of epoch's permuted stream so all "
                        "%d ranks have equal batch counts", n % world, world)
        if self.batch_size == 1:
            n -= n % world
        per_rank = B.rank_fixed_sizes(slot_sizes(n, world), self.batch_size)
        batches = [B.deal(sizes, workers, w) for sizes in per_rank for w in range(workers)]
        return [sum(b) for b in batches], batches

    @functools.cache
    def _lengths(self) -> dict[tuple[str, str], list[int]]:
        import pyarrow.parquet as pq

        from eagle_data.stream.shards import _dir_of, _join

        out: dict[tuple[str, str], list[int]] = {}
        for murl in self.manifests:
            base = _dir_of(murl)
            try:
                t = pq.read_table(_join(base, INDEX_NAME), columns=["shard", "num_tokens"])
            except Exception as e:
                raise ValueError(f"max_tokens batching needs {base}/index.parquet: {e}") from e
            for name, n in zip(t.column("shard").to_pylist(), t.column("num_tokens").to_pylist()):
                out.setdefault((murl, name), []).append(min(n, self.read.max_length or n))
        over = [n for lens in out.values() for n in lens if n > self.read.max_tokens]
        info = get_worker_info()
        if over and (info is None or info.id == 0):  # once per rank, not once per worker
            log.warning("%d sample(s) are longer than max_tokens=%d (the longest: %d tokens): each forms a batch "
                        "of its own, above the token budget; max_length <= max_tokens cuts them instead",
                        len(over), self.read.max_tokens, max(over))
        return out

    def _rng(self, epoch: int, slot: int) -> random.Random:
        return random.Random(f"{self.read.seed}:{epoch}:{slot}")

    def plan(self, epoch: int, world: int, workers: int, slot: int):
        """``(spans, batches)`` of one slot (``slot = rank * workers + worker``).

        Fixed mode: the spans of the slot's own samples and its share ``j % workers == worker`` of
        its rank's batch sizes. Token mode: the batches of the rank are planned once over the
        rank's part of the stream (:func:`eagle_data.stream.plan.token_plan`, then split until
        every rank has as many), and the slot gets its share ``j % workers == worker`` of them as
        lists of rank-local positions, with the spans of the whole rank part (the worker reads it
        and keeps its positions): so the batches are the same whatever the number of workers."""
        sizes, fixed = self._sizes(world, workers)
        order = epoch_shard_order(self.shards, self.read.seed, epoch, self.read.shuffle)
        if fixed is not None:
            return slot_spans(order, sizes, slot), fixed[slot]
        rank, worker = divmod(slot, workers)
        plans, rd = [], self.read
        for r in range(world):
            lens = [n for sp in slot_spans(order, sizes, r)
                    for n in self._lengths()[(sp.shard.manifest, sp.shard.name)][sp.start:sp.stop]]
            plans.append((lens, B.token_plan(lens, self._buf(), self._rng(epoch, r), rd.bucket_window, rd.max_tokens,
                                             rd.max_batch_size, rd.shuffle_initial)))
        target = max(len(p) for _, p in plans)
        return slot_spans(order, sizes, rank), B.deal(B.split_to(plans[rank][1], target, plans[rank][0]), workers, worker)

    def _buf(self) -> int:
        return self.read.shuffle_buffer if self.read.shuffle else 0

    def batches_per_rank(self, num_workers: int | None = None, epoch: int | None = None) -> int:
        """Batches each rank yields in ``epoch`` (same on every rank)."""
        k = max(1, num_workers if num_workers is not None else self.num_workers)
        _, world = self.rank_world()
        return sum(len(self.plan(self.epoch if epoch is None else epoch, world, k, w)[1]) for w in range(k))

    def __len__(self) -> int:
        return self.batches_per_rank()

    # ---- iteration -----------------------------------------------------------------------------
    def _decode(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        where = f"{raw['__url__']}:{raw['__key__']}"
        t = view_tensors(raw["safetensors"], where=where)
        h, a = t["hidden_states"], t["aux_hidden_states"]
        if h.shape[1] != self.hidden_size or a.shape[1] != self.aux_width \
                or h.dtype != self.stored["hidden_states"] or a.dtype != self.stored["aux_hidden_states"]:
            raise SampleError(where, f"hidden {tuple(h.shape)} {h.dtype} / aux {tuple(a.shape)} {a.dtype} disagree "
                                     f"with the manifest (H={self.hidden_size}, aux {self.stored['aux_hidden_states']}, "
                                     f"final {self.stored['hidden_states']}): a mixed-dtype dataset is refused")
        t = expand_final_rows(t)  # final_rows="taught": the rows scattered back before any cut
        if self.read.max_length is not None:
            t = {k: v[:self.read.max_length] for k, v in t.items()}
        return t

    def _drop(self, reason: str, where: str, err: BaseException) -> None:
        """Apply the error policy to one sample: raise naming it, or count and log."""
        if self.read.on_error == "raise":
            if isinstance(err, SampleError):  # names the sample already
                raise err
            raise SampleError(where, str(err)) from err
        self.skipped[reason] += 1
        log.warning("skipping %s sample %s: %s", reason, where, err)

    def _collate(self, raws: list[dict[str, Any] | None]) -> dict[str, Any]:
        samples, keys, wheres, holes = [], [], [], 0
        for r in raws:
            if r is not None:
                where = f"{r['__url__']}:{r['__key__']}"
                try:
                    samples.append(self._decode(r))
                    keys.append(r["__key__"])
                    wheres.append(where)
                    continue
                except (ValueError, OSError) as e:  # OSError: reading a local shard's payload
                    self._drop("undecodable", where, e)
            holes += 1
        while True:
            if not samples:  # every sample skipped: a filler row keeps the step count (DDP) and shapes
                samples, keys, wheres = [self._filler()], [C.FILLER_KEY], ["filler"]
            # in a DataLoader worker the batch is built in shared memory, so torch does not copy
            # it again to send it to the main process
            try:
                return C.collate(samples, keys, self.hidden_size, self.aux_width, self.dtype, holes,
                                 shared=get_worker_info() is not None, threads=self.read_threads,
                                 pool=self._pool)
            except C.SampleReadError as e:  # hidden states unreadable now (shard changed, I/O error)
                for i in sorted(e.errors, reverse=True):
                    self._drop("unreadable", wheres[i], e.errors[i])
                    del samples[i], keys[i], wheres[i]
                    holes += 1

    def _filler(self) -> dict[str, torch.Tensor]:
        """A 2-token sample of zeros with no supervised token (see :data:`~eagle_data.stream.collate.FILLER_KEY`)."""
        return {"input_ids": torch.zeros(2, dtype=torch.int64), "loss_mask": torch.zeros(2, dtype=torch.uint8),
                "aux_hidden_states": torch.zeros(2, self.aux_width, dtype=self.dtype),
                "hidden_states": torch.zeros(2, self.hidden_size, dtype=self.dtype)}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This slot's batches. In a DataLoader worker, a data error (``ValueError``: a
        :class:`~eagle_data.stream.reader.ShardError`, a :class:`~eagle_data.format.schema.SampleError`)
        ends the stream as one item ``{WORKER_ERROR: exc}``, which :class:`~eagle_data.stream.loader.EagleDataLoader`
        raises in the main process as it is (torch would wrap it in its worker traceback, or in a
        ``RuntimeError`` when the type takes other arguments)."""
        if get_worker_info() is None:
            yield from self._batches()
            return
        try:
            yield from self._batches()
        except ValueError as e:
            yield {WORKER_ERROR: e}

    def _batches(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:  # a worker (persistent ones keep an old copy of this object)
            self.epoch, self.skip_batches = int(self._epoch_cell[0]), int(self._epoch_cell[1])
        rank, world = self.rank_world()
        wi = get_worker_info()
        k, w = (wi.num_workers, wi.id) if wi is not None else (1, 0)
        # After resuming at rank batch s, DataLoader worker 0 must serve logical worker s % k
        # (the DataLoader's round-robin always starts at worker 0).
        w = (w + self.skip_batches) % k
        slot = rank * k + w
        spans, batches = self.plan(self.epoch, world, k, slot)
        skip = max(0, math.ceil((self.skip_batches - w) / k))  # this worker's batches among those consumed
        # token mode: every worker of the rank reads the rank's part, so only worker 0 logs what it finds unreadable
        quiet = self.batch_size is None and w != 0
        raw = (r for sp in spans for r in read_span(sp, self.read.on_error, self.skipped, quiet))
        if self.batch_size is not None:
            stream = B.shuffle_stream(raw, self._buf(), self._rng(self.epoch, slot), self.read.shuffle_initial)
            for j, size in enumerate(batches):
                group = [next(stream) for _ in range(size)]
                if j >= skip:
                    yield self._collate(group)
            return
        need = {i for b in batches[skip:] for i in b}  # this worker's positions still to serve
        pending: dict[int, Any] = {}
        pos = enumerate(raw)
        for b in batches[skip:]:
            while any(i not in pending for i in b):
                i, r = next(pos)
                if i in need:
                    pending[i] = r
            yield self._collate([pending.pop(i) for i in b])


def decode_hf_example(example: dict[str, Any]) -> dict[str, Any]:
    """Decode one row of ``datasets.load_dataset("webdataset", data_files=..., split="train")``.

    HF's webdataset builder yields ``{"__key__", "__url__", "safetensors": bytes, "json": dict}``
    (it decodes nothing else; no pickle). Returns ``{"key", "input_ids" [T] int64,
    "loss_mask" [T] uint8, "aux_hidden_states" [T, 3H], "hidden_states" [T, H] (fp8 storage:
    dequantised to bfloat16), "meta"}``.

    Raises:
        ValueError: missing or undecodable ``safetensors`` member.
    """
    data = example.get("safetensors")
    if data is None:
        raise ValueError(f"sample {example.get('__key__')}: no safetensors member")
    t = dequantize_fields(expand_final_rows(decode_tensors(bytes(data), where=str(example.get("__key__")))))
    return {"key": example.get("__key__"), **t, "meta": example.get("json")}
