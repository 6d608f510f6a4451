"""What a run records so that a rerun resumes it (:func:`run_config`), and the rerun with
nothing to do (:func:`finished_result`), answered before the target model loads: for a large
target that load is minutes, and a rerun of a finished extraction should say "done" at once.

A rerun has nothing to do only when every fact a full rerun would check is provably the same:
every rank finished, its shards are on disk as recorded, the source files are byte for byte the
ones it read (their fingerprint), the row extent (``num_samples``) and every resume setting are
unchanged, and no row was skipped for a reason the model's numbers decide
(:data:`DECIDED_BY_STATES`: a rerun decides those again; a row skipped for its text, template or
length is skipped again by the same source and settings). Anything else takes the full path,
which resumes, repairs or refuses as before.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.manifest import RanksDisagree, merge
from eagle_data.extract.resume import check_resume, load_progress
from eagle_data.extract.rank_state import source_record
from eagle_data.format.fingerprint import weights_fingerprint

log = logging.getLogger(__name__)

#: skip reasons of the captured states (not of the row's text): a rerun may decide them otherwise
DECIDED_BY_STATES = frozenset({"non_finite_hidden_states"})


def run_config(cfg: ExtractConfig, aux_layer_ids: Sequence[int], renderer: ChatRenderer, model_path: str,
               tag: str) -> dict[str, Any]:
    """The run configuration a rank's progress file records (what a resume must match); ``cfg``
    as :func:`~eagle_data.extract.run.run_extract` resolved it (``num_samples``, storage dtypes)."""
    tok_json = Path(model_path) / "tokenizer.json"
    run_cfg: dict[str, Any] = {
        **asdict(cfg), "model_path": model_path, "dataset_tag": tag, "aux_layer_ids": list(aux_layer_ids),
        "weights_fingerprint": weights_fingerprint(model_path),
        "tokenizer_sha256": hashlib.sha256(tok_json.read_bytes()).hexdigest() if tok_json.exists() else None,
        "template": renderer.describe()}
    run_cfg.pop("progress")
    return run_cfg


def finished_result(cfg: ExtractConfig, out: Path, renderer: ChatRenderer, model_path: str,
                    tag: str) -> dict[str, Any] | None:
    """``run_extract``'s result for a rerun with nothing to do (module doc), without loading the
    model; ``None``: the full path decides."""
    prev = load_progress(out, cfg.rank)
    if not (prev and prev.get("finished") and not DECIDED_BY_STATES & set(prev["skipped"].values())
            and (cfg.on_bad_sample != "raise" or not prev["skipped"])  # a skipped row must now fail the run
            and (prev.get("source") or {}).get("fingerprint") and prev["config"].get("num_samples") == cfg.num_samples):
        return None
    progs = [load_progress(out, r) for r in range(cfg.world_size)]
    if not all(p and p.get("finished") for p in progs) or any(
            not (out / s["name"]).is_file() or (out / s["name"]).stat().st_size != s["bytes"] for s in prev["shards"]):
        return None
    try:
        ids = _aux_layer_ids(cfg.aux_layer_ids, model_path, cfg.trust_remote_code)
        check_resume(prev, run_config(cfg, ids, renderer, model_path, tag), "")
        if source_record(cfg.data)["fingerprint"] != prev["source"]["fingerprint"]:
            return None
    except (ValueError, OSError):  # the full path says what differs
        return None
    stats = {"new_samples": 0, "new_tokens": 0, "seconds": 0.0, "tokens_per_s": None,
             "total_tokens": sum(s["num_tokens"] for s in prev["shards"]), "front": "none (nothing to do)",
             "skip_counts": {}, "note_counts": {}, "nothing_to_do": True}
    log.info("rank %d of %s: already finished with this source and these settings; nothing to do",
             cfg.rank, out)
    return merged_result(out, cfg.rank, {"progress": prev, "run_stats": stats})


def merged_result(out: Path, rank: int, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` (this finished rank's progress and stats) as the merged manifest when every rank
    has finished; with ``"merge_error"`` (logged) when the merge refuses ranks that disagree (this
    rank is done; the others must rerun, and the last of them merges)."""
    if not all((p := load_progress(out, r)) is not None and p.get("finished")
               for r in range(result["progress"]["world_size"])):
        return result
    try:  # idempotent if several ranks race
        return {**merge(out), "run_stats": result["run_stats"]}
    except RanksDisagree as e:
        log.error("rank %d finished, but the dataset is not merged: %s", rank, e)
        return {**result, "merge_error": str(e)}


def _aux_layer_ids(aux_layer_ids: Sequence[int] | None, model_path: str, trust_remote_code: bool) -> list[int]:
    """The aux ids a backend would resolve, from the model's config alone (no weights)."""
    from transformers import AutoConfig

    from eagle_data.engines.base import default_aux_layer_ids, validate_aux_layer_ids

    top = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    n = int((getattr(top, "text_config", None) or top).num_hidden_layers)
    return validate_aux_layer_ids(aux_layer_ids, n) if aux_layer_ids is not None else default_aux_layer_ids(n)
