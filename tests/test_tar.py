"""The tar framing (eagle_data.format.tar) and its readers: the walk against tarfile's own
``getmembers()`` on ustar/pax/GNU archives from seekable files and streams, corrupt and truncated
archives as CorruptTar, header writing byte-equal to tarfile, the loader's read_span contract,
read_samples and inspect's read_sample."""

from __future__ import annotations

import io
import os
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_data.format.payload import FileSlice
from eagle_data.format.tar import (CorruptTar, TarWalk, archive_end, is_meta, member_padding, split_key,
                                   tar_member_header)
from eagle_data.stream.reader import ShardError, open_url, read_span
from eagle_data.stream.shards import ShardInfo, Span
from eagle_data.tools.synthetic import sample_value, write_synthetic


class _ReadOnly:
    """A non-seekable stream with ``read`` only (like verify's hashing reader)."""

    def __init__(self, data: bytes):
        self._b = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._b.read(n)

    def close(self) -> None:
        self._b.close()


def _payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(i * 300))  # sizes 0, 300, 600, ...: some not block multiples


def _archive(fmt: int, names: list[str], pax_headers: dict | None = None) -> bytes:
    """An archive of regular members ``names`` (member i holds :func:`_payload` (i)), plus a
    directory and a symlink with a long target."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_headers or {}) as tf:
        for i, name in enumerate(names):
            ti = tarfile.TarInfo(name)
            ti.size = len(_payload(i))
            tf.addfile(ti, io.BytesIO(_payload(i)))
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        ln = tarfile.TarInfo("link.json")
        ln.type, ln.linkname = tarfile.SYMTYPE, "t" * 150 if fmt != tarfile.USTAR_FORMAT else "t"
        tf.addfile(ln)
    return buf.getvalue()


LONG = "d" * 130 + "/" + "k" * 120 + ".safetensors"  # > 255 characters: pax path / GNU longname
FORMATS = {
    "ustar-prefix": (tarfile.USTAR_FORMAT, ["a.json", "p" * 120 + "/key.safetensors", "__meta__", "b.c.json"], None),
    "gnu-longname": (tarfile.GNU_FORMAT, ["a.json", LONG, "x" * 140 + ".json", "__k__/x.json"], None),
    "pax-x-and-g": (tarfile.PAX_FORMAT, ["a.json", LONG, "ü" * 60 + ".json", "e.bin"], {"comment": "global"}),
}


def _sources(tmp_path: Path, data: bytes):
    path = tmp_path / "a.tar"
    path.write_bytes(data)
    yield "file", open(path, "rb", buffering=0)
    yield "bytesio", io.BytesIO(data)
    yield "read-only", _ReadOnly(data)
    yield "pipe", open_url(f"pipe:cat {path}")


@pytest.mark.parametrize("kind", FORMATS)
def test_walk_equals_tarfile_offsets_sizes_and_data(tmp_path, kind):
    fmt, names, pax = FORMATS[kind]
    data = _archive(fmt, names, pax)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:  # the oracle
        ref = [(m.name, m.offset_data, m.size) for m in tf.getmembers()]
        ref_data = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isreg()}
        types = {m.name: m.type for m in tf.getmembers()}
    if kind == "pax-x-and-g":
        assert data[156:157] == b"g" and b"x" in {data[i + 156:i + 157] for i in range(0, len(data), 512)}
    if kind == "gnu-longname":
        assert {data[i + 156:i + 157] for i in range(0, len(data), 512)} >= {b"L", b"K"}
    samples = [r for r in ref if types[r[0]] == tarfile.REGTYPE and not is_meta(r[0])]
    assert len(samples) == sum(not is_meta(n) for n in names) and any(len(n) > 100 for n, _, _ in samples)
    for src, f in _sources(tmp_path, data):
        walk = TarWalk(f, src)
        assert walk.seekable == (src in ("file", "bytesio"))
        got = []
        for m in walk.members():
            got.append((m.name, m.offset, m.size))
            assert (m.key, m.ext) == split_key(m.name) and m.sample
            if m.offset % 1024:  # read about half of the members; the walk skips the others
                arr = walk.read(m)
                assert arr.dtype == np.uint8 and arr.flags.writeable and arr.tobytes() == ref_data[m.name], src
        assert got == samples, src
        f.close()
    everything = [(m.name, m.offset, m.size, m.sample) for m in TarWalk(io.BytesIO(data)).members(everything=True)]
    assert [e[:3] for e in everything] == ref and [e[3] for e in everything] == [r in samples for r in ref]


def test_base256_size_and_numbers(tmp_path):
    """A size in GNU base-256 (as tar writes sizes >= 8 GiB) reads like tarfile reads it."""
    h = bytearray(tar_member_header("big.bin", 0))
    h[124:136] = b"\x80" + (700).to_bytes(11, "big")
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    data = bytes(h) + b"q" * 700 + member_padding(700) + tar_member_header("z.json", 3) + b"abc" + member_padding(3)
    data += archive_end(len(data))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        ref = [(m.name, m.offset_data, m.size) for m in tf.getmembers()]
    assert ref[0] == ("big.bin", 512, 700)
    for src, f in _sources(tmp_path, data):
        walk = TarWalk(f, src)
        assert [(m.name, m.offset, m.size) for m in walk.members()] == ref, src
        f.close()


def test_seekable_walk_reads_headers_only(tmp_path):
    write_synthetic(tmp_path, [20], hidden_size=64, length=lambda g: 40)
    shard = next(tmp_path.glob("*.tar"))

    class Counting(io.FileIO):
        n = 0

        def read(self, size=-1):
            b = super().read(size)
            Counting.n += len(b)
            return b
    with Counting(shard) as f:
        assert sum(1 for _ in TarWalk(f).members()) == 40
    assert Counting.n == (40 + 1) * 512 < shard.stat().st_size / 20  # 40 headers + the end block


def _blob(*members: tuple[str, bytes]) -> bytes:
    out = b"".join(tar_member_header(n, len(d)) + d + member_padding(len(d)) for n, d in members)
    return out + archive_end(len(out))


def _with_header(data: bytes, at: int, edit) -> bytes:
    h = bytearray(data[at:at + 512])
    edit(h)
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return data[:at] + bytes(h) + data[at + 512:]


def _pax_length_0() -> bytes:
    ti = tarfile.TarInfo("././@PaxHeader")
    ti.size, ti.type = 9, tarfile.XHDTYPE
    return ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape") + b"0 path=x\n" + bytes(503)


GOOD = _blob(("a.json", b"x" * 700), ("a.safetensors", b"y" * 100), ("b.json", b"z" * 1024))  # headers at 0, 1536, 2560
CORRUPT = {
    "truncated-data": (GOOD[:2100], "unexpected end of tar data"),
    "truncated-header": (GOOD[:2560 + 300], "corrupt tar header at byte 2560"),
    "bad-checksum-mid-archive": (GOOD[:2560 + 20] + b"!" + GOOD[2560 + 21:], "corrupt tar header at byte 2560"),
    "negative-size": (_with_header(GOOD, 2560, lambda h: h.__setitem__(slice(124, 136), b"\xff" + (256 ** 11 - 512)
                                                                      .to_bytes(11, "big"))), "negative size"),
    "pax-length-0-mid-archive": (GOOD[:2560] + _pax_length_0() + GOOD[2560:], "corrupt tar header at byte 2560"),
    "empty": (b"", "corrupt tar header at byte 0"),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_or_truncated_archives_raise_corrupttar_naming_it(tmp_path, case):
    data, msg = CORRUPT[case]
    for src, f in _sources(tmp_path, data):
        walk = TarWalk(f, f"ARCHIVE-{src}")
        with pytest.raises(CorruptTar, match=msg) as e:
            for m in walk.members():
                if src in ("read-only", "pipe") and m.name == "a.json":
                    walk.read(m)
        assert isinstance(e.value, ValueError) and not isinstance(e.value, tarfile.TarError)
        assert f"ARCHIVE-{src}" in str(e.value)
        f.close()


def test_stream_member_can_only_be_read_while_current():
    walk = TarWalk(_ReadOnly(GOOD))
    it = walk.members()
    first = next(it)
    assert walk.read(first).tobytes() == b"x" * 700
    with pytest.raises(ValueError, match="current"):
        walk.read(first)
    nxt = next(it)
    with pytest.raises(ValueError, match="current"):
        walk.read(first)
    assert walk.read(nxt).tobytes() == b"y" * 100


def test_split_key_and_meta_are_webdatasets():
    from webdataset.tariterators import base_plus_ext

    for name in ("a.json", "a.b.safetensors", "d/k.x.y", "d.e/k.json", "noext", "d/noext", ".hidden", "a."):
        want = base_plus_ext(name)
        assert split_key(name) == (want if want[0] is not None else (None, None)), name
    assert is_meta("__key__") and is_meta("__dir__/x.json") and not is_meta("a__b__.json") and not is_meta("d/__x")


@pytest.mark.parametrize("sizes", [[0], [1, 512, 513], [9216 - 1024 - 512]])  # the last ends on a record
def test_header_writing_equals_tarfile_ustar(sizes):
    members = [(f"k{i}.bin", bytes([i]) * n) for i, n in enumerate(sizes)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, d in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode, ti.uname, ti.gname = len(d), 0, 0o444, "bigdata", "bigdata"
            tf.addfile(ti, io.BytesIO(d))
    assert _blob(*members) == buf.getvalue() and len(buf.getvalue()) % 10240 == 0


# ---- the loader's read_span -------------------------------------------------------------------

def _span(url: str, start: int, stop: int, n: int) -> Span:
    return Span(ShardInfo(url=url, name=Path(url.split()[-1]).name, num_samples=n), start, stop)


def test_read_span_local_slices_with_readahead_and_stream_arrays(tmp_path, monkeypatch):
    write_synthetic(tmp_path, [6], hidden_size=8)
    shard = next(tmp_path.glob("*.tar"))
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, a, n, adv: (calls.append((a, n, adv)), real(fd, a, n, adv)))
    with tarfile.open(shard) as tf:
        ref = {m.name: (m.offset_data, tf.extractfile(m).read()) for m in tf.getmembers()}
    local = list(read_span(_span(str(shard), 2, 5, 6), "raise", Counter()))
    assert [s["__key__"] for s in local] == [f"syn_{g:09d}" for g in (2, 3, 4)]
    for s in local:
        for ext in ("json", "safetensors"):
            off, data = ref[f"{s['__key__']}.{ext}"]
            assert isinstance(s[ext], FileSlice) and s[ext].offset == off and s[ext].tobytes() == data
    assert calls and all(adv == os.POSIX_FADV_WILLNEED for _, _, adv in calls)
    assert calls[0][0] == local[0]["json"].offset and calls[-1][0] + calls[-1][1] == shard.stat().st_size
    streamed = list(read_span(_span(f"pipe:cat {shard}", 2, 5, 6), "raise", Counter()))
    assert [s["__key__"] for s in streamed] == [s["__key__"] for s in local]
    for s in streamed:
        assert all(isinstance(s[e], np.ndarray) and s[e].tobytes() == ref[f"{s['__key__']}.{e}"][1]
                   for e in ("json", "safetensors"))


@pytest.mark.parametrize("stream", [False, True], ids=["local", "pipe"])
def test_read_span_duplicate_member_and_holes(tmp_path, stream):
    write_synthetic(tmp_path, [3], hidden_size=8)
    shard = next(tmp_path.glob("*.tar"))
    with tarfile.open(shard) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    members.insert(3, members[2])  # syn_000000001.json twice
    shard.write_bytes(_blob(*members))
    url = f"pipe:cat {shard}" if stream else str(shard)
    with pytest.raises(ShardError, match=r"00000-000000.tar: unreadable at sample 'syn_000000001'.*duplicate"):
        list(read_span(_span(url, 0, 3, 3), "raise", Counter()))
    skipped = Counter()
    got = list(read_span(_span(url, 0, 3, 3), "skip", skipped))
    assert [s and s["__key__"] for s in got] == ["syn_000000000", None, None] and skipped["unreadable_shard"] == 2


def _damaged_third_header(tmp_path) -> tuple[Path, int]:
    """A 4-sample shard whose syn_000000002.json header has a flipped byte: (shard, header offset)."""
    write_synthetic(tmp_path, [4], hidden_size=8)
    shard = next(tmp_path.glob("*.tar"))
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tf:
        third = tf.getmembers()[4].offset  # header of syn_000000002.json
    data[third + 3] ^= 1
    shard.write_bytes(bytes(data))
    return shard, third


def test_read_span_corrupt_header_names_shard_not_tarerror(tmp_path):
    shard, third = _damaged_third_header(tmp_path)
    with pytest.raises(ShardError, match=rf"{shard}: unreadable at sample 'syn_000000001'.*corrupt tar header at byte "
                                         rf"{third}") as e:
        list(read_span(_span(str(shard), 0, 4, 4), "raise", Counter()))
    assert isinstance(e.value.__cause__, CorruptTar)


@pytest.mark.parametrize("damage", ["header", "truncate"])
def test_damage_at_a_sample_loses_that_sample_not_the_intact_one_before_it(tmp_path, damage):
    """The walk breaks at syn_000000002's first member: syn_000000001, whose members were all
    read, is still handed out (it used to wait for the next key and be lost with it)."""
    write_synthetic(tmp_path, [4], hidden_size=8)
    shard = next(tmp_path.glob("*.tar"))
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tf:
        third = tf.getmembers()[4].offset  # header of syn_000000002.json
    if damage == "header":
        data[third + 3] ^= 1
    else:
        data = data[:third + 700]  # ends inside syn_000000002.json's data
    shard.write_bytes(bytes(data))
    skipped = Counter()
    got = list(read_span(_span(str(shard), 0, 4, 4), "skip", skipped))
    assert [s and s["__key__"] for s in got] == ["syn_000000000", "syn_000000001", None, None]
    assert sum(skipped.values()) == 2, skipped


def test_damage_after_a_span_costs_that_span_nothing(tmp_path, caplog):
    shard, _ = _damaged_third_header(tmp_path)
    skipped = Counter()
    with caplog.at_level("WARNING"):
        got = list(read_span(_span(str(shard), 0, 2, 4), "skip", skipped))
    assert [s["__key__"] for s in got] == ["syn_000000000", "syn_000000001"]
    assert not skipped and not [r for r in caplog.records if "skipping" in r.getMessage()]


# ---- read_samples and inspect ------------------------------------------------------------------

def test_read_samples_and_inspect_read_sample(tmp_path):
    import eagle_train.evaluate as ev
    from eagle_data.tools.inspect import read_sample
    from eagle_data.tools.read_samples import read_samples

    assert ev.read_samples is read_samples
    write_synthetic(tmp_path, [3, 4], hidden_size=8)
    got = read_samples(tmp_path, ["syn_000000005", "syn_000000001"])
    assert sorted(got) == ["syn_000000001", "syn_000000005"]
    for k, t in got.items():
        g = int(k[4:])
        assert (t["input_ids"] == g).all() and t["input_ids"].shape == (4 + g % 5,)
        assert torch.equal(t["hidden_states"].float(), torch.full((4 + g % 5, 8), sample_value(g)))
        assert t["aux_hidden_states"].shape == (4 + g % 5, 24)
    with pytest.raises(ValueError, match="not found.*syn_000000099"):
        read_samples(tmp_path, ["syn_000000001", "syn_000000099"])
    tensors, meta = read_sample(tmp_path / "00000-000001.tar", "syn_000000004")
    assert meta["source_row"] == 4 and (tensors["input_ids"] == 4).all()
    with pytest.raises(ValueError, match="syn_000000001 not found"):
        read_sample(tmp_path / "00000-000001.tar", "syn_000000001")
