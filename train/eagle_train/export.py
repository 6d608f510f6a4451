"""Export a trained drafter: an SGLang ``LlamaForCausalLMEagle3`` folder (default) or a vLLM
``speculators``-format folder (:func:`speculators_hf_config`).

``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, the
drafter sizes, ``vocab_size`` = target V, ``draft_vocab_size`` = N, ``tie_word_embeddings:
false`` (SGLang would otherwise alias ``lm_head`` to the full embedding), rope settings and
``rms_norm_eps`` copied from the target, ``eagle_config.eagle_aux_hidden_state_layer_ids`` =
the dataset manifest's ids (convention: :data:`eagle_data.format.schema.LAYER_ID_CONVENTION`),
``target_hidden_size`` only when it differs from ``hidden_size``.

``model.safetensors``: ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
``t2d`` (SGLang maps ``midlayer`` -> ``model.layers.0`` and stacks q/k/v, gate/up itself); no
``embed_tokens`` (SGLang shares the target's).

``format="speculators"`` (what vLLM serves, and the ``speculators`` package's
``SpeculatorModel.from_pretrained`` loads): the same tensors with ``midlayer.`` renamed
``layers.0.``, plus ``embed_tokens.weight`` (the target's embedding, ``[V, H]``, in ``dtype``),
and the config of :func:`speculators_hf_config`. The embedding is shipped because
``SpeculatorModel.from_pretrained`` (speculators 0.9.0) takes the verifier's embedding only
where the parameter is still NaN, and transformers has already filled the missing parameter
(with uninitialised memory), so without it the loaded drafter embeds with garbage, silently.
Its cost is the file size: ``V x H`` more (Llama-3-8B: 128256 x 4096 in bf16, about 1 GiB).
vLLM loads it too; a copy equal to the target's is dropped for the target's
(``has_own_embed_tokens`` + ``torch.equal`` in its EAGLE proposer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

#: target config keys copied verbatim when present
_COPY = ("rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
         "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")


def draft_hf_config(drafter, target_config: dict[str, Any], aux_layer_ids: list[int],
                    dtype: str = "bfloat16") -> dict[str, Any]:
    c = drafter.cfg
    cfg: dict[str, Any] = {k: target_config[k] for k in _COPY if target_config.get(k) is not None}
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
                         "use_aux_hidden_state": True},
    })
    if c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    return cfg


#: the speculators release whose format :func:`speculators_hf_config` writes (tested with its loader)
SPECULATORS_VERSION = "0.9.0"


def speculators_hf_config(drafter, target_config: dict[str, Any], aux_layer_ids: list[int], dtype: str,
                          verifier: Optional[str], speculative_tokens: int = 7) -> dict[str, Any]:
    """``config.json`` of the speculators format (``speculators_model_type: eagle3``).

    * No top-level ``model_type``: vLLM takes the speculators path only without one.
    * ``norm_before_residual: false``: the residual is taken before ``hidden_norm`` (as trained
      here and in SGLang); vLLM's default when the key is missing is ``true``.
    * ``eagle_aux_hidden_state_layer_ids``: vLLM's id ``k`` captures the stream entering layer
      ``k`` (HF ``hidden_states[k]``); the ids stored here mean HF ``hidden_states[k + 1]``
      (:data:`eagle_data.format.schema.LAYER_ID_CONVENTION`), so ``k + 1`` is written.
    * ``verifier.name_or_path``: the target (``vllm serve DIR`` serves it with this drafter).
    """
    c = drafter.cfg
    layer: dict[str, Any] = {k: target_config[k] for k in _COPY if target_config.get(k) is not None}
    layer.update({"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                  "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                  "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
                  "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False})
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": c.target_hidden_size if c.target_hidden_size != c.hidden_size else None,
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in aux_layer_ids],
        "tie_word_embeddings": False, "torch_dtype": dtype, "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.get("architectures") or [])}},
    }


def export_drafter(drafter, target_config: dict[str, Any], aux_layer_ids: list[int], out_dir: str | Path,
                   dtype: str = "bfloat16", format: str = "sglang", verifier: Optional[str] = None,
                   speculative_tokens: Optional[int] = None, overwrite: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float weights in ``dtype``; d2t int64, t2d bool),
    both readable by others as the umask allows (a server may run as another user).

    Args:
        format: "sglang" or "speculators" (vLLM); verifier and speculative_tokens (default 7):
            the speculators config's target name or path and draft length (speculators only).
        overwrite: replace an export already in ``out_dir`` (otherwise refused).
    """
    from safetensors.torch import save

    if format not in ("sglang", "speculators"):
        raise ValueError(f"export format must be 'sglang' or 'speculators' (vLLM), got {format!r}")
    if format == "sglang" and (verifier is not None or speculative_tokens is not None):
        raise ValueError("verifier and speculative_tokens belong to the speculators (vLLM) format; SGLang takes "
                         "the draft length at launch (--speculative-num-steps)")
    speculative_tokens = 7 if speculative_tokens is None else speculative_tokens
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    if verifier is not None and not verifier.strip():
        raise ValueError("verifier must name the target (a hub name or a path), got an empty string")
    if not aux_layer_ids:
        raise ValueError("aux_layer_ids are required (the dataset manifest's ids): the checkpoint records none "
                         "(trained without model.dataset_dir or model.drafter.aux_layer_ids); pass --aux_layer_ids")
    if format == "sglang":
        from eagle_data.engines.base import check_served_aux_ids

        check_served_aux_ids(aux_layer_ids, target_config.get("architectures"))
    if getattr(drafter, "zero_features", False):
        raise ValueError("this drafter was trained with zero_features (a control that ignores the target's "
                         "states); a server would feed it real states, so it is not exported")
    from eagle_data.format.schema import hidden_dtype

    dt = hidden_dtype(dtype)  # checked before anything is written
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: {out} exists and is not a directory (give a directory to write "
                         f"config.json + model.safetensors into)")
    held = [n for n in ("config.json", "model.safetensors") if (out / n).exists()]
    if held and not overwrite:
        raise ValueError(f"export: {out} already holds {' and '.join(held)}; choose another folder or pass "
                         f"--overwrite true")
    out.mkdir(parents=True, exist_ok=True)
    rename = (lambda k: k.replace("midlayer.", "layers.0.", 1)) if format == "speculators" else (lambda k: k)
    tensors = dict(drafter.export_state_dict())
    if format == "speculators":  # speculators' from_pretrained would leave it unfilled (module doc)
        tensors["embed_tokens.weight"] = drafter.embed_tokens
    sd = {rename(k): (v.to(dt) if v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in tensors.items()}
    (out / "model.safetensors").write_bytes(save(sd, metadata={"format": "pt"}))  # save_file: always 0600
    cfg = draft_hf_config(drafter, target_config, aux_layer_ids, dtype) if format == "sglang" else \
        speculators_hf_config(drafter, target_config, aux_layer_ids, dtype, verifier, speculative_tokens)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def default_verifier(target_model_path: str) -> str:
    """The speculators config's ``verifier`` when none is given: the target folder the drafter was
    trained against, as an absolute path on this machine (give a hub name or a path the server finds)."""
    from eagle_train.model import resolve_model_path

    return str(resolve_model_path(target_model_path).resolve())


def export_checkpoint(checkpoint: str, out_dir: str, dtype: str = "bfloat16",
                      aux_layer_ids: Optional[list[int]] = None, format: str = "sglang",
                      verifier: Optional[str] = None, speculative_tokens: Optional[int] = None,
                      overwrite: bool = False, target_model: Optional[str] = None) -> Path:
    """Export a Lightning checkpoint of :class:`eagle_train.module.EagleDrafterModule`
    (``verifier`` default: the checkpoint's target folder, as an absolute path; ``target_model``:
    the target's folder when it moved since training)."""
    from eagle_train.module import EagleDrafterModule

    over = {"target_model_path": target_model} if target_model else {}
    mod = EagleDrafterModule.load_from_checkpoint(checkpoint, map_location="cpu", **over)
    if aux_layer_ids and mod.aux_layer_ids and list(aux_layer_ids) != list(mod.aux_layer_ids):
        raise ValueError(f"aux_layer_ids {list(aux_layer_ids)}: the checkpoint's drafter was trained on layers "
                         f"{list(mod.aux_layer_ids)}")
    ids = aux_layer_ids or mod.aux_layer_ids
    if format == "speculators" and verifier is None:
        verifier = default_verifier(mod.hparams.target_model_path)
    return export_drafter(mod.drafter, mod.target_config, ids, out_dir, dtype, format, verifier, speculative_tokens,
                          overwrite)


def load_exported_drafter(folder: str | Path, target_model_path: str | Path):
    """Read an SGLang-format export back into an :class:`eagle_train.model.Eagle3Drafter` (float32),
    with the target's ``embed_tokens`` (which the export leaves to the server): what the server
    runs, for replaying it offline (``serve-check``).

    Returns:
        ``(drafter, aux_layer_ids)``.

    Raises:
        ValueError: the folder lacks a file, is in the speculators (vLLM) format, its config misses
            a field, or a tensor is missing, extra or of another shape (names the folder and tensor).
    """
    from safetensors.torch import load_file

    from eagle_train.model import DraftConfig, Eagle3Drafter, load_target_tensors

    d = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (d / name).is_file():
            raise ValueError(f"{d}: no {name} (give the folder `eagle-data export` wrote)")
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{d}/config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{d}/config.json must hold a JSON object, got {type(cfg).__name__}")
    if cfg.get("speculators_model_type"):
        raise ValueError(f"{d}: a speculators (vLLM) export; SGLang serves the default format "
                         f"(`eagle-data export CKPT DIR`)")
    try:
        ids = [int(i) for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        dc = DraftConfig.from_target(cfg, int(cfg["draft_vocab_size"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{d}/config.json: missing or malformed field ({type(e).__name__}: {e}); not an eagle-data "
                         f"export?") from None
    dc.target_hidden_size = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    try:
        sd = load_file(str(d / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{d}/model.safetensors is unreadable ({type(e).__name__}: {e})") from None
    for name in ("d2t", "t2d"):
        if name not in sd:
            raise ValueError(f"{d}/model.safetensors: no {name} tensor")
    try:
        embed = load_target_tensors(target_model_path, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    except KeyError as e:  # not a (safetensors) model folder: a setting, not a bug
        raise ValueError(f"target {target_model_path}: {e.args[0] if e.args else e}") from None
    if tuple(embed.shape) != (dc.vocab_size, dc.hidden_size):
        raise ValueError(f"{d}: drafter for a target with vocab {dc.vocab_size} x hidden {dc.hidden_size}, but "
                         f"{target_model_path} embeds {tuple(embed.shape)}: another target")
    drafter = Eagle3Drafter(dc, embed.float(), sd.pop("d2t"), sd.pop("t2d"))
    own = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary.") and k not in ("d2t", "t2d")}
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    bad = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or extra or bad:
        raise ValueError(f"{d}/model.safetensors does not fit its config.json: missing {missing[:5]}, extra "
                         f"{extra[:5]}, other shape {bad[:5]}")
    drafter.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    return drafter.float().eval(), ids
