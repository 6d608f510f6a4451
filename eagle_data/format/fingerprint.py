"""The identities a dataset records: of a model folder (``config.weights_fingerprint`` of the
manifest: extraction writes it, a resume and training compare it) and of a local source's files
(``source`` of each rank's progress file: the merge refuses ranks that read different sources)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def weights_fingerprint(model_path: str | Path) -> str:
    """Cheap identity of a model folder: sha256 over names, sizes and the first/last MiB of each
    weight file and ``config.json`` (hashing a 1 TB checkpoint in full is not practical: weights
    that differ only in the middle of a large file, e.g. a fine-tune of a few inner layers, are not
    told apart); ``"n/a"`` for a path that is not a folder (e.g. a hub id)."""
    p = Path(model_path)
    if not p.is_dir():
        return "n/a"
    h = hashlib.sha256()
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) + sorted(p.glob("config.json")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 1 << 20:  # the last MiB, or what the first left
                fh.seek(max(1 << 20, size - (1 << 20)))
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def files_fingerprint(files: list[str | Path]) -> dict[str, object]:
    """The identity of a local source (``progress``'s ``source.fingerprint``): sha256 over each
    file's name (relative to the folder the files share, so that a copy elsewhere is the same
    source), size and whole content, in the order given (the order rows are numbered in); with
    the number of files and their total size. Unlike :func:`weights_fingerprint` every byte counts
    (an edited row is another source); hashing runs at disk speed, far faster than the parsing of
    the rows an extraction does anyway.

    Raises:
        OSError: a file cannot be read.
    """
    import os

    paths = [Path(f) for f in files]
    base = os.path.commonpath([str(p.absolute().parent) for p in paths]) if paths else ""
    h, total = hashlib.sha256(), 0
    for p in paths:
        size = p.stat().st_size
        h.update(f"{os.path.relpath(p.absolute(), base)}:{size}:".encode("utf-8", "surrogatepass"))
        with open(p, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
        total += size
    return {"fingerprint": h.hexdigest(), "files": len(paths), "bytes": total}
