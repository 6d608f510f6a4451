"""The identity of a model folder as a dataset records it (``config.weights_fingerprint`` of the
manifest): extraction writes it, a resume and training compare it."""

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
