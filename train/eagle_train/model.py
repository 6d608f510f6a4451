"""EAGLE-3 draft model in the layout SGLang's ``LlamaForCausalLMEagle3`` serves.

Sources: EAGLE-3 paper (arXiv 2503.01840); SGLang 0.5.23 ``srt/models/llama_eagle3.py`` (names,
shapes, the fused residual/norm order); SpecForge ``specforge/modeling/draft/llama3_eagle.py``
(training-time test with cached keys).

Tensors (``H`` = draft hidden = target hidden here, ``Ht`` = target hidden, ``N`` = draft vocab):

* ``fc.weight`` ``[H, 3*Ht]`` (no bias): aux states (low, mid, high concatenated) -> ``H``;
* ``midlayer.*``: one Llama decoder layer whose q/k/v read ``[input_layernorm(embed) ‖
  hidden_norm(hidden)]`` (``2H`` inputs); ``o_proj``, ``post_attention_layernorm``, ``mlp``;
* ``norm.weight`` ``[H]``, ``lm_head.weight`` ``[N, H]``; buffers ``d2t`` int64 ``[N]``,
  ``t2d`` bool ``[V]``;
* ``embed_tokens`` ``[V, H]``: the TARGET's frozen embedding (non-persistent buffer; SGLang
  shares the target's at serving time, so it is never exported).

One drafter step (SGLang ``LlamaDecoderLayer.forward`` with ``is_input_layer``)::

    residual = hidden                                   # fc(aux) at step 0, own output later
    x = cat(input_layernorm(embed), hidden_norm(hidden))          # [B, T, 2H]
    h = o_proj(attn(rope(q(x)), rope(k(x)), v(x))) + residual
    out = mlp(post_attention_layernorm(h)) + h                      # pre-norm hidden: fed back
    logits = lm_head(norm(out))                                     # [B, T, N]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle_train.attention import ttt_attention, ttt_attention_reference  # noqa: F401 (re-exported)
from eagle_train.compiled import compiled
from eagle_train.layers import DraftDecoderLayer, RMSNorm, layer_finish, layer_qkv, autocast_matrices


@dataclass
class DraftConfig:
    """Sizes of the drafter; :meth:`from_target` copies them from the target's ``config.json``."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                 # target V
    draft_vocab_size: int           # N
    target_hidden_size: int
    num_aux_hidden_states: int = 3
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"

    @classmethod
    def from_target(cls, target_config: dict[str, Any], draft_vocab_size: int) -> "DraftConfig":
        c = target_config
        rope = c.get("rope_parameters") or dict(c.get("rope_scaling") or {}, rope_theta=c.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        return cls(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                   num_attention_heads=c["num_attention_heads"],
                   num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                   head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                   vocab_size=c["vocab_size"], draft_vocab_size=draft_vocab_size,
                   target_hidden_size=c["hidden_size"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=c.get("max_position_embeddings", 8192), rope_parameters=dict(rope),
                   hidden_act=c.get("hidden_act", "silu"))

    def hf_llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters), num_hidden_layers=1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_model_path(model_path: str | Path) -> Path:
    """``"smollm2"`` -> the embedded SmolLM2 folder (:func:`eagle_data.assets.smollm2_model_dir`);
    otherwise the path with ``~`` expanded."""
    if str(model_path) == "smollm2":
        from eagle_data.assets import smollm2_model_dir

        return smollm2_model_dir()
    return Path(model_path).expanduser()


def read_target_config(model_path: str | Path) -> dict[str, Any]:
    return json.loads((resolve_model_path(model_path) / "config.json").read_text())


def load_target_tensors(model_path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` from a (possibly sharded) safetensors checkpoint with ``safe_open``.

    ``lm_head.weight`` falls back to ``model.embed_tokens.weight`` (tied embeddings).

    Raises:
        KeyError: a name is in no file.
    """
    from safetensors import safe_open

    p = resolve_model_path(model_path)
    idx = p / "model.safetensors.index.json"
    if idx.exists():
        wmap = json.loads(idx.read_text())["weight_map"]
    else:
        files = sorted(p.glob("*.safetensors"))
        wmap = {}
        for f in files:
            with safe_open(str(f), "pt") as fh:
                wmap.update({k: f.name for k in fh.keys()})
    out = {}
    for n in names:
        src = n if n in wmap else ("model.embed_tokens.weight" if n == "lm_head.weight" else None)
        if src is None or src not in wmap:
            raise KeyError(f"{model_path}: tensor {n!r} not found")
        with safe_open(str(p / wmap[src]), "pt") as fh:
            out[n] = fh.get_tensor(src)
    return out


class Eagle3Drafter(nn.Module):
    """The trainable drafter plus the target's frozen ``embed_tokens`` (buffer, not exported).

    Args:
        cfg: sizes.
        embed_tokens: target embedding [V, H] (frozen).
        d2t: int64 [N]; t2d: bool [V] (see :mod:`eagle_train.vocab`).
        lm_head_init: optional [N, H] initial draft head (e.g. target ``lm_head`` rows at the
            draft ids); default: ``nn.Linear`` init.

    Attribute ``zero_features`` (default False): a control that replaces the target's aux states
    by zeros in training and drafting alike (measures what the target's states contribute).
    Attribute ``compile_layer`` (default False): :meth:`ttt_forward` runs the decoder layer's two
    halves (norms + q/k/v + rope; o_proj + residual + norm + MLP) through ``torch.compile`` on
    CUDA (:mod:`eagle_train.compiled`; the same math, fewer kernels).
    """

    zero_features: bool = False
    compile_layer: bool = False

    def __init__(self, cfg: DraftConfig, embed_tokens: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                 lm_head_init: Optional[torch.Tensor] = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_aux_hidden_states * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DraftDecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if lm_head_init is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_init)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(config=cfg.hf_llama_config())
        self.register_buffer("embed_tokens", embed_tokens.detach().clone(), persistent=False)
        self.register_buffer("d2t", d2t.to(torch.int64).clone())
        self.register_buffer("t2d", t2d.to(torch.bool).clone())

    def target_ids(self) -> torch.Tensor:
        """int64 [N]: target id of each draft id (``arange(N) + d2t``, SGLang's ``hot_token_id``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_tokens).to(self.fc.weight.dtype)

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """positions [B, T] int64 -> (cos, sin) [B, T, hd]."""
        return self.rotary(like, positions)

    def _features(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3*Ht] in the drafter's dtype; zeros for the ``zero_features`` control."""
        aux = aux.to(self.fc.weight.dtype)
        return torch.zeros_like(aux) if self.zero_features else aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """pre-norm hidden [B, T, H] -> draft logits [B, T, N]."""
        return self.lm_head(self.norm(hidden))

    def ttt_forward(self, input_ids: torch.Tensor, aux: torch.Tensor, key_valid: torch.Tensor, steps: int,
                    positions: Optional[torch.Tensor] = None, attn_impl: str = "auto") -> list[torch.Tensor]:
        """Unrolled training-time test over all rows at once.

        Row ``r`` of step ``k`` reads token ``input_ids[:, r + k]`` (0 beyond the end) and, at step 0,
        ``fc(aux[:, r])``, later its own pre-norm output of step ``k - 1``; rope position ``r + k``.
        Attention (:func:`eagle_train.attention.ttt_attention`, memory linear in ``T``): step-0
        keys at rows ``<= r`` that are valid, plus the keys of the same row at steps ``1..k``.

        Args:
            input_ids: [B, T] int64, tokens already shifted so that row ``r`` pairs token ``x[r+1]``
                with ``aux[r]`` (see :mod:`eagle_train.loss`).
            aux: [B, T, 3*Ht] target aux states.
            key_valid: [B, T] bool, False at padding.
            steps: K.
            attn_impl: ``impl`` of :func:`eagle_train.attention.ttt_attention` ("auto": compiled
                flex_attention on CUDA, chunked elsewhere).

        Returns:
            K pre-norm hidden states [B, T, H] (one per step).
        """
        b, t = input_ids.shape
        if key_valid.shape != (b, t):
            raise ValueError(f"key_valid {tuple(key_valid.shape)} != input_ids {(b, t)}")
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        key_valid, cache = key_valid.bool(), {}
        qkv, finish = layer_qkv, layer_finish
        if self.compile_layer:
            qkv = compiled("drafter.qkv", layer_qkv, input_ids.device)
            finish = compiled("drafter.finish", layer_finish, input_ids.device)
        weights = autocast_matrices(self.midlayer)  # one cast per forward, shared by the K steps
        hidden = self.fc(self._features(aux))
        outs, k0 = [], None
        extra_k: list[torch.Tensor] = []
        extra_v: list[torch.Tensor] = []
        for k in range(steps):
            ids = F.pad(input_ids[:, k:], (0, min(k, t)))  # x[r + k], 0 beyond the end (also when T <= k)
            cos, sin = self.rope(positions + k, hidden)
            q, kk, vv = qkv(self.midlayer, weights, self.embed(ids), hidden, cos, sin)
            if k == 0:
                k0, v0 = kk, vv
            else:
                extra_k.append(kk)
                extra_v.append(vv)
            attn = ttt_attention(q, k0, v0, key_valid, extra_k, extra_v, impl=attn_impl, cache=cache)
            hidden = finish(self.midlayer, weights, attn, hidden)
            outs.append(hidden)
        return outs

    @torch.no_grad()
    def propose_chain(self, input_ids: torch.Tensor, aux: torch.Tensor, rows: list[int], first_tokens: list[int],
                      steps: int, first_token_id: Optional[int] = None) -> torch.Tensor:
        """Greedy chain drafting (SGLang chain / topk=1 semantics) for several rows of one sequence.

        Step 0 for the prefix rows ``< r`` uses the real shifted tokens (their keys are the KV
        cache of the draft extend); row ``r`` uses ``first_tokens`` (the target's verified token at
        position ``r``) with ``fc(aux[r])``; step ``k`` feeds the previous draft token and the own
        pre-norm hidden at rope position ``r + k`` and attends to the prefix keys + its own keys.

        Args:
            input_ids: [T] shifted tokens (row ``r`` holds ``x[r+1]``); aux: [T, 3*Ht].
            rows: rows ``r`` to draft from; first_tokens: target token at each row.
            steps: K proposals per row.
            first_token_id: ``x[0]``; unused here (row ``r`` already pairs ``x[r+1]`` with ``g[r]``),
                part of the proposer interface (:class:`eagle_train.ngram.PromptLookupDrafter`).

        Returns:
            int64 [len(rows), K] target ids of the proposals.
        """
        t = input_ids.shape[0]
        pos = torch.arange(t, device=input_ids.device)[None]
        hid0 = self.fc(self._features(aux[None]))
        cos, sin = self.rope(pos, hid0)
        _, kp, vp = self.midlayer.qkv(self.embed(input_ids[None]), hid0, cos, sin)
        tids = self.target_ids()
        out = torch.zeros(len(rows), steps, dtype=torch.int64)
        for i, (r, tok) in enumerate(zip(rows, first_tokens)):
            hidden = hid0[:, r: r + 1]
            token = torch.tensor([[tok]], device=input_ids.device)
            k0 = v0 = None
            ek, ev = [], []
            for k in range(steps):
                cos, sin = self.rope(pos[:, r: r + 1] + k, hidden)
                q, kk, vv = self.midlayer.qkv(self.embed(token), hidden, cos, sin)
                if k == 0:
                    k0, v0 = torch.cat([kp[:, :, :r], kk], 2), torch.cat([vp[:, :, :r], vv], 2)
                else:
                    ek.append(kk)
                    ev.append(vv)
                mask = torch.ones(1, 1, 1, r + 1, dtype=torch.bool, device=q.device)
                hidden = self.midlayer.finish(ttt_attention_reference(q, k0, v0, mask, ek, ev), hidden)
                token = tids[self.logits(hidden).argmax(-1)]
                out[i, k] = token.item()
        return out

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the names SGLang's ``LlamaForCausalLMEagle3.load_weights`` consumes."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        assert "embed_tokens" not in sd
        return sd
