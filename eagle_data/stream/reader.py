"""Shard reading for the loader: open a shard URL, walk its tar members
(:class:`eagle_data.format.tar.TarWalk`) and group them by key with webdataset's rules (turning a
payload into tensors is :mod:`eagle_data.format.payload`'s job).

One stage: ``read_span(span)`` yields the raw samples ``span.start .. span.stop - 1`` of one
shard: members of a local file are :class:`~eagle_data.format.payload.FileSlice` descriptors (read
later, straight into the batch, after asynchronous readahead), those of other streams are read
into memory member by member. Errors name the shard URL and the sample key.
"""

from __future__ import annotations

import io
import logging
import os
import re
import stat
from collections import Counter
from typing import Any, Callable, Iterator

from eagle_data.format.payload import FileSlice, LocalFile
from eagle_data.format.tar import Member, TarWalk
from eagle_data.stream.shards import Span

log = logging.getLogger(__name__)

REQUIRED_MEMBERS = ("safetensors", "json")


def open_url(url: str):
    """Open a shard: local path / ``file://`` unbuffered (the reader does large reads itself),
    ``pipe:`` and ``http(s)`` via ``webdataset.gopen``; every other scheme (``s3://``, ``gs://``,
    ``az://``, ...) via ``fsspec``."""
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", url)
    if m is None and not url.startswith("pipe:"):
        return open(url, "rb", buffering=0)
    if m is not None and m.group(1) == "file":
        return open(url[len("file://"):], "rb", buffering=0)
    if m is None or m.group(1) in ("http", "https"):
        import webdataset as wds

        return wds.gopen(url, "rb")
    import fsspec

    return fsspec.open(url, "rb").open()


class _Readahead:
    """The members of a local shard as :class:`~eagle_data.format.payload.FileSlice` descriptors
    on a duplicate of the stream's descriptor (it outlives the stream: samples still in a shuffle
    buffer point into it), each with asynchronous readahead of its bytes and the next
    ``LOOKAHEAD`` (cold cache: the disk works while earlier batches are collated)."""

    LOOKAHEAD = 16 << 20

    def __init__(self, file: LocalFile, end: int):
        self.file, self.end, self.done = file, end, 0  # readahead requested up to ``done``

    @classmethod
    def of(cls, stream) -> "_Readahead | None":
        """For a non-empty local regular file at offset 0, else None (stream reads)."""
        try:
            fd = stream.fileno()
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or stream.tell() != 0:
                return None
            return cls(LocalFile(os.dup(fd), getattr(stream, "name", "?")), st.st_size)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return None

    def slice(self, offset: int, size: int) -> FileSlice:
        stop = min(self.end, offset + size + self.LOOKAHEAD)
        if stop > self.done:
            a = max(offset, self.done)
            try:
                os.posix_fadvise(self.file.fd, a, stop - a, os.POSIX_FADV_WILLNEED)
            except (AttributeError, OSError):
                pass
            self.done = stop
        return FileSlice(self.file, offset, size)


def _grouped(walk: TarWalk, span: Span, read: Callable[[Member], Any], at: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Samples ``span.start .. span.stop - 1`` of the walk's members grouped by key like
    webdataset's ``group_by_keys`` (members before the span are not read); ``read(member)`` gives
    a member's data. ``at["seen"]``: keys seen so far; ``at["key"]``: the sample being read.

    Raises:
        ValueError: a member name twice in one sample.
    """
    cur, sample = None, None
    try:
        for m in walk.members():
            if m.key is None:
                continue
            if m.key != cur:
                at["seen"], cur = at["seen"] + 1, m.key
            if at["seen"] > span.stop:
                break
            if at["seen"] <= span.start:
                continue
            if sample is None or m.key != sample["__key__"]:
                if sample is not None:
                    yield sample
                sample = {"__key__": m.key, "__url__": span.shard.url}
                at["key"] = m.key
            ext = m.ext.lower()
            if ext in sample:
                sample = None  # not handed out: which of its two members is right is unknown
                raise ValueError(f"{m.name}: duplicate file name in tar file {ext}")
            sample[ext] = read(m)
    except Exception:
        # the walk broke at a later member (a corrupt or truncated header): a sample whose
        # members were all read is intact and handed out before the error (its payload is
        # still checked when decoded)
        if sample is not None and all(r in sample for r in REQUIRED_MEMBERS):
            yield sample
        raise
    if sample is not None:
        yield sample


def read_span(span: Span, on_error: str, skipped: Counter, quiet: bool = False) -> Iterator[dict[str, Any] | None]:
    """Stage "tar": the raw samples ``span.start .. span.stop - 1`` of one shard, in order: a
    dict ``{"__key__", "__url__", ext: data}`` per sample, ``data`` a
    :class:`~eagle_data.format.payload.FileSlice` for a local file (readahead requested), else a
    uint8 numpy array read from the stream. Samples before the span are skipped without
    reading their data.

    With ``on_error="skip"`` an unreadable sample becomes ``None`` (a hole that keeps positions
    and batch counts stable), is counted in ``skipped`` and logged (``quiet``: not logged, where
    another reader of the same span logs it); with ``"raise"``:

    Raises:
        ShardError: truncated/corrupt tar, missing member, or fewer samples than the manifest
            says; the message names the shard URL and the sample key.
    """
    sh, want, got, at = span.shard, span.stop - span.start, 0, {"seen": 0, "key": None}
    stream = None
    try:
        stream = open_url(sh.url)
        walk, ahead = TarWalk(stream, sh.url), _Readahead.of(stream)
        read = (lambda m: ahead.slice(m.offset, m.size)) if ahead is not None else walk.read
        for sample in _grouped(walk, span, read, at):
            got += 1
            yield _checked(sample, on_error, skipped, quiet)
        if got < want:
            raise ShardError(f"shard {sh.url}: expected {span.stop} samples, the tar ends after "
                             f"{at['seen']} (truncated?)")
    except Exception as e:
        if on_error == "raise":
            if isinstance(e, ShardError):  # already names the shard
                raise
            key = at["key"]
            where = f"at sample {key!r} (or the member after it)" if key is not None else "before its first sample"
            raise ShardError(f"shard {sh.url}: unreadable {where}: {e!r}") from e
        if got < want:  # else the damage lies after this span's samples, all of which were read
            skipped["unreadable_shard"] += want - got
            if not quiet:
                log.warning("skipping %d sample(s) of %s: %r", want - got, sh.url, e)
            yield from [None] * (want - got)
    finally:
        if stream is not None:
            stream.close()


class ShardError(ValueError):
    """A shard cannot be read; the message names the shard (and the sample where known)."""


def _checked(s: dict[str, Any], on_error: str, skipped: Counter, quiet: bool = False) -> dict[str, Any] | None:
    missing = [m for m in REQUIRED_MEMBERS if m not in s]
    if not missing:
        return s
    err = ShardError(f"shard {s['__url__']}: sample {s['__key__']} lacks member(s) {missing}")
    if on_error == "raise":
        raise err
    skipped["missing_field"] += 1
    if not quiet:
        log.warning("skipping: %s", err)
    return None
