"""Tiny random targets of the families the project serves (CPU tests, GPU parity benchmarks)."""

from __future__ import annotations

import torch


def deepseek_v3_config(num_hidden_layers: int = 8, vocab_size: int = 600):
    """A tiny DeepSeek-V3 (Kimi-K2.5's family): MLA attention (q/kv LoRA, decoupled rope, yarn), a dense
    first layer, then MoE layers of 8 routed experts (grouped sigmoid top-k) + 1 shared expert. The
    keys transformers' config lacks but the real config.json has (SGLang reads them) are set too."""
    import transformers as T

    cfg = T.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=2048, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    for k, v in dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1).items():
        setattr(cfg, k, v)
    return cfg


def save_tiny_target(kind: str, path, vocab_size: int = 256) -> str:
    """Save a tiny random ``llama``, ``deepseek_v3`` or ``qwen3_moe`` (8 layers, hidden 64, fp32) to
    ``path``; returns it."""
    import transformers as T

    torch.manual_seed(0)
    if kind == "deepseek_v3":
        model = T.DeepseekV3ForCausalLM(deepseek_v3_config(8, vocab_size))
    elif kind == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size))
    elif kind == "qwen3_moe":
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            max_position_embeddings=2048))
    else:
        raise ValueError(f"unknown tiny target {kind!r} (llama, deepseek_v3, qwen3_moe)")
    model.save_pretrained(path)
    return str(path)
