"""The on-disk schema of eagle-data shards, declared once.

A dataset directory holds:

* WebDataset shards (names: :mod:`eagle_data.format.layout`). Each sample is two tar members
  sharing one key (``KEY.safetensors`` and ``KEY.json``), so stock
  ``webdataset.WebDataset`` and ``datasets.load_dataset("webdataset", ...)`` group them.
* ``index.parquet``: one row per sample (see :data:`INDEX_COLUMNS`).
* ``manifest.json``: run configuration, model facts, per-shard sha256/bytes/counts,
  skip counts by reason, package versions. ``schema_version`` is checked by every reader.

Per sample tensors (inside ``KEY.safetensors``, no pickle anywhere; safetensors stores
bf16 as raw bits, so it round-trips bit-exactly):

==================== ============ ========= ==========================================
name                 shape        dtype     meaning
==================== ============ ========= ==========================================
``input_ids``        [T]          int64     ONE tokenisation of the rendered chat text
``loss_mask``        [T]          uint8     1 iff token carries assistant text/end-of-turn
``aux_hidden_states``[T, 3*H]     bf16/f32  outputs of decoder layers ``aux_layer_ids``
                                            (low→high, concatenated on the last dim)
``hidden_states``    [T, H]       bf16/f32  final hidden state AFTER the final norm
                     or [n, H]              (what ``lm_head`` consumes); ``final_rows =
                                            "taught"``: only the n rows whose next token is
                                            supervised (:mod:`eagle_data.format.final_rows`)
``*_scale``          [T, G]       f32       only beside a field stored as fp8: one scale per
                                            token and layer group (3 for aux, 1 for final;
                                            :mod:`eagle_data.format.fp8`)
==================== ============ ========= ==========================================

Storage dtypes (:data:`STORAGE_DTYPES`): bfloat16, float16, float32, or ``float8_e4m3fn`` with
per-(token, layer) scales; aux and final states may differ (``storage_dtype`` /
``final_storage_dtype``; the manifest's ``dtype`` / ``final_dtype``). Readers hand fp8 fields out
dequantised to bfloat16 (:func:`batch_dtype`). The manifest's ``final_rows`` says which rows
``hidden_states`` holds: ``"all"`` or ``"taught"``. Readers read :data:`SCHEMA_VERSION` only
(versions 1 and 2 were never released).

Layer-id convention (:data:`LAYER_ID_CONVENTION`): aux id ``k`` is the output of decoder
layer ``k`` (0-based), i.e. HF ``output_hidden_states[k + 1]``; this is what SGLang's
``eagle_config.eagle_aux_hidden_state_layer_ids`` means in a draft config it serves
(SGLang's ``set_eagle3_layers_to_capture`` captures the *input* of layer ``k + 1``).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import torch
from safetensors.torch import load as st_load

from eagle_data.format.names import HIDDEN_DTYPE_NAMES, MAX_TAG_BYTES, STORAGE_DTYPE_NAMES, TENSOR_EXT

from eagle_data.format import final_rows
from eagle_data.format.fp8 import scale_name

#: the version of the format this code writes and reads (the only one released)
SCHEMA_VERSION = 3
LAYER_ID_CONVENTION = "output_of_decoder_layer_k=hf_hidden_states[k+1]"
FINAL_STATE_NORM = "post"  # hidden_states are taken after the model's final norm

META_EXT = "json"
TENSOR_FIELDS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
INT_DTYPES = {"input_ids": torch.int64, "loss_mask": torch.uint8}
HIDDEN_DTYPES = {n: getattr(torch, n) for n in HIDDEN_DTYPE_NAMES}
#: hidden-state dtypes a shard may store (the compute dtypes + fp8 with scales)
STORAGE_DTYPES = {n: getattr(torch, n) for n in STORAGE_DTYPE_NAMES}
#: layer groups of each hidden field (the width of its scale tensor when stored as fp8)
HIDDEN_FIELDS = ("aux_hidden_states", "hidden_states")

#: index.parquet columns: name -> (Arrow type, meaning)
INDEX_FIELDS = {
    "key": (pa.string(), "sample key (no '.'), unique across shards and ranks"),
    "shard": (pa.string(), "shard file name relative to the dataset directory"),
    "source_id": (pa.string(), "id of the conversation in the source dataset"),
    "source_row": (pa.int64(), "row number in the source dataset"),
    "num_turns": (pa.int32(), "number of messages after normalisation"),
    "num_tokens": (pa.int32(), "T, tokens stored"),
    "num_loss_tokens": (pa.int32(), "tokens with loss_mask == 1"),
    "truncated": (pa.bool_(), "True if the rendered chat was cut at max_length"),
    "loss_token_ids": (pa.list_(pa.int32()), "sorted distinct token ids with loss_mask == 1 (draft-vocab histogram)"),
    "loss_token_counts": (pa.list_(pa.int32()), "how often each of loss_token_ids occurs under the loss mask"),
}
INDEX_COLUMNS = {k: meaning for k, (_, meaning) in INDEX_FIELDS.items()}
INDEX_SCHEMA = pa.schema([(k, t) for k, (t, _) in INDEX_FIELDS.items()])


class SampleError(ValueError):
    """One stored sample is unreadable or breaks the schema; the message starts with
    ``sample WHERE:`` and ``where`` (``URL:KEY`` or the key) names it."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"sample {where}: {problem}")
        self.where, self.problem = where, problem

    def __reduce__(self):  # pickled by DataLoader workers: rebuilt from both arguments
        return type(self), (self.where, self.problem)


def _dtype_named(name: str, table: dict[str, torch.dtype], field: str) -> torch.dtype:
    if name not in table:
        raise ValueError(f"{field} must be one of {sorted(table)}, got {name!r}")
    return table[name]


def hidden_dtype(name: str, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a hidden-state (compute) dtype name (:data:`HIDDEN_DTYPES`).

    Raises:
        ValueError: an unknown name, naming ``field``.
    """
    return _dtype_named(name, HIDDEN_DTYPES, field)


def storage_dtype_of(name: str, field: str = "storage_dtype") -> torch.dtype:
    """The torch dtype of a storage dtype name (:data:`STORAGE_DTYPES`: the compute dtypes + fp8).

    Raises:
        ValueError: an unknown name, naming ``field``.
    """
    return _dtype_named(name, STORAGE_DTYPES, field)


def batch_dtype(stored: torch.dtype) -> torch.dtype:
    """The dtype readers hand out for a stored dtype: fp8 is dequantised to bfloat16."""
    return torch.bfloat16 if stored == torch.float8_e4m3fn else stored


def sample_key(dataset_tag: str, row: int) -> str:
    """Stable sample key from (dataset, source row). Never contains '.'.

    Raises:
        ValueError: ``dataset_tag`` contains '.', '/' or whitespace, or the key does not fit a tar
            member name (a tag over :data:`MAX_TAG_BYTES` bytes).
    """
    if not dataset_tag or any(c in dataset_tag for c in "./ \t\n"):
        raise ValueError(f"dataset tag {dataset_tag!r} must be non-empty without '.', '/' or spaces")
    key = f"{dataset_tag}_{row:09d}"
    if len(f"{key}.{TENSOR_EXT}".encode("utf-8")) > 100:
        raise ValueError(f"dataset tag {dataset_tag!r} is {len(dataset_tag.encode('utf-8'))} bytes (UTF-8): shard "
                         f"member names (TAG_ROW.{TENSOR_EXT}) must fit a tar header's 100 bytes; give a --dataset_tag "
                         f"of at most {MAX_TAG_BYTES} bytes")
    return key


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64",
              torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
#: safetensors dtype name -> torch dtype, for readers that parse the header themselves
ST_DTYPES_BY_NAME = {v: k for k, v in _ST_DTYPES.items()}


def safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> list:
    """The safetensors encoding of ``tensors`` as buffers, without copying tensor memory.

    Returns ``[header_bytes, memoryview, ...]`` whose concatenation is a valid safetensors
    file (8-byte little-endian header size, JSON header padded with spaces to 8 bytes, then
    the raw little-endian data; tensors ordered by decreasing item size, then name, as the
    reference implementation does). :func:`decode_tensors` (``safetensors.torch.load``) reads it.

    Raises:
        ValueError: a dtype outside the schema.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    views, off = [], 0
    for name in order:
        t = tensors[name]
        t = t if t.is_contiguous() else t.contiguous()
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not in the schema")
        nb = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nb]}
        off += nb
        if nb:
            flat = t if t.dim() and t.stride(-1) == 1 else t.reshape(-1)  # (a size-1 last dim may have any stride)
            views.append(memoryview(flat.view(torch.uint8).numpy()))
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    return [len(h).to_bytes(8, "little") + h, *views]


def encode_sample_parts(key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]):
    """Pack one sample as ``{"safetensors": [buffers], "json": [bytes]}``, the payloads of the
    tar members ``KEY.safetensors`` and ``KEY.json``; tensor memory is not copied (see
    :func:`safetensors_parts`).

    Args:
        key: sample key, must not contain '.' (webdataset splits keys at the first dot).
        tensors: the four :data:`TENSOR_FIELDS` (see module docstring for shapes/dtypes).
        meta: JSON-serialisable metadata.

    Raises:
        ValueError: bad key, missing field or inconsistent shapes.
    """
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
    validate_tensors(tensors, where=key)
    names = [*TENSOR_FIELDS, *(scale_name(k) for k in HIDDEN_FIELDS if scale_name(k) in tensors)]
    return {TENSOR_EXT: safetensors_parts({k: tensors[k] for k in names}, {"schema_version": str(SCHEMA_VERSION)}),
            META_EXT: [json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")]}


def decode_tensors(data: bytes, where: str = "?") -> dict[str, torch.Tensor]:
    """Decode ``KEY.safetensors`` bytes into the four tensors (bit-exact, no pickle).

    Raises:
        ValueError: unreadable bytes, missing fields or inconsistent shapes; names ``where``.
    """
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types
        raise SampleError(where, f"cannot decode safetensors payload: {e}") from e
    validate_tensors(tensors, where=where)
    return tensors


def validate_tensors(tensors: dict[str, torch.Tensor], where: str = "?") -> None:
    """Check fields, dtypes and ``rows == len(input_ids) == len(loss_mask)`` (``hidden_states``:
    that, or the taught rows of :mod:`eagle_data.format.final_rows`).

    Raises:
        ValueError: naming the sample ``where`` and the offending field.
    """
    missing = [k for k in TENSOR_FIELDS if k not in tensors]
    if missing:
        raise SampleError(where, f"missing field(s) {missing}")
    for name, dtype in INT_DTYPES.items():
        if tensors[name].dtype != dtype or tensors[name].dim() != 1:
            raise SampleError(where, f"{name} must be 1-D {dtype}, got "
                             f"{tuple(tensors[name].shape)} {tensors[name].dtype}")
    t = tensors["input_ids"].shape[0]
    aux, fin = tensors["aux_hidden_states"], tensors["hidden_states"]
    if fin.dim() != 2 or aux.dim() != 2:
        raise SampleError(where, "hidden states must be 2-D [T, *]")
    if not (tensors["loss_mask"].shape[0] == aux.shape[0] == t):
        raise SampleError(
            where, f"row mismatch: input_ids {t}, loss_mask {tensors['loss_mask'].shape[0]}, "
            f"aux_hidden_states {aux.shape[0]}, hidden_states {fin.shape[0]}")
    if final_rows.layout(fin.shape[0], tensors["loss_mask"]) is None:
        raise SampleError(
            where, f"hidden_states has {fin.shape[0]} rows: neither every token's ({t}) nor one per "
            f"supervised next token ({final_rows.num_taught(tensors['loss_mask'])}, final_rows='taught')")
    if aux.shape[1] % fin.shape[1] != 0:
        raise SampleError(where, f"aux width {aux.shape[1]} is not a multiple of H={fin.shape[1]}")
    for name, groups in (("aux_hidden_states", aux.shape[1] // fin.shape[1]), ("hidden_states", 1)):
        _check_storage(tensors, name, groups, where)


def _check_storage(tensors: dict[str, torch.Tensor], name: str, groups: int, where: str) -> None:
    """A hidden field's dtype is a storage dtype; an fp8 field has its [T, groups] float32 scale
    (finite, > 0), any other field none."""
    x, sn = tensors[name], scale_name(name)
    if x.dtype not in STORAGE_DTYPES.values():
        raise SampleError(where, f"{name}: dtype {x.dtype} is not a storage dtype")
    if x.dtype != torch.float8_e4m3fn:
        if sn in tensors:
            raise SampleError(where, f"{sn} given for {name} stored as {x.dtype} (only fp8 fields have scales)")
        return
    sc = tensors.get(sn)
    if sc is None or sc.dtype != torch.float32 or tuple(sc.shape) != (x.shape[0], groups):
        got = "missing" if sc is None else f"{tuple(sc.shape)} {sc.dtype}"
        raise SampleError(where, f"{name} is fp8 but {sn} is {got}, expected [{x.shape[0]}, {groups}] float32")
    if sc.numel() and not (torch.isfinite(sc).all() and (sc > 0).all()):
        raise SampleError(where, f"{sn} holds a non-finite or non-positive scale")


def check_manifest_compat(manifest: dict[str, Any], expect: dict[str, Any] | None = None,
                          where: str = "manifest") -> None:
    """Refuse data whose schema or model facts differ from what the caller expects.

    Args:
        manifest: a parsed ``manifest.json``.
        expect: optional ``{"hidden_size", "aux_layer_ids", "dtype", ...}`` to match.
        where: the file the manifest was read from (named in the errors).

    Raises:
        ValueError: schema version, layer convention, final norm or an expected field differs.
    """
    v = manifest.get("schema_version")
    if v != SCHEMA_VERSION:
        raise ValueError(f"{where}: schema_version {v!r}; this eagle_data reads schema_version {SCHEMA_VERSION} "
                         "only (re-extract the dataset with it)")
    if manifest.get("layer_id_convention") != LAYER_ID_CONVENTION:
        raise ValueError(f"{where}: layer_id_convention {manifest.get('layer_id_convention')!r} "
                         f"!= {LAYER_ID_CONVENTION!r}")
    if manifest.get("final_state_norm") != FINAL_STATE_NORM:
        raise ValueError(f"{where}: final_state_norm {manifest.get('final_state_norm')!r} != 'post'")
    for k, want in (expect or {}).items():
        if want is None:
            continue
        got = manifest.get(k)
        if isinstance(want, (list, tuple)):
            want, got = list(want), list(got or [])
        if got != want:
            raise ValueError(f"{where}: {k} is {got!r}, expected {want!r}")
