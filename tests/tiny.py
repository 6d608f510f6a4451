"""Shared tiny random Llama for exactness tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

AUX = [1, 3, 5]


def tiny_llama(seed: int = 0, vocab: int = 600) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


def tiny_family(family: str):
    """A tiny random model of ``family`` (fp32, CPU): sliding windows of 4 tokens where the family has them."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=600, hidden_size=64, num_attention_heads=4, num_hidden_layers=6)
    kv = dict(common, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=256)
    cfg, cls = {
        "llama": (lambda: T.LlamaConfig(**kv), T.LlamaForCausalLM),
        "mistral_window_4": (lambda: T.MistralConfig(**kv, sliding_window=4), T.MistralForCausalLM),
        "gemma3_local_global": (lambda: T.Gemma3TextConfig(**kv, head_dim=16, sliding_window=4,
                                                           sliding_window_pattern=2), T.Gemma3ForCausalLM),
        "gemma3_bidirectional": (lambda: T.Gemma3TextConfig(**kv, head_dim=16, use_bidirectional_attention=True),
                                 T.Gemma3ForCausalLM),
        "bloom_alibi": (lambda: T.BloomConfig(vocab_size=600, hidden_size=64, n_head=4, n_layer=6),
                        T.BloomForCausalLM),
        "gpt2": (lambda: T.GPT2Config(vocab_size=600, n_embd=64, n_head=4, n_layer=6, n_positions=256),
                 T.GPT2LMHeadModel),
        # experts' grouped matmuls round a row by its place in the batch (~1e-6 on CPU)
        "olmoe": (lambda: T.OlmoeConfig(**kv, num_experts=4, num_experts_per_tok=2), T.OlmoeForCausalLM),
        "qwen3_moe": (lambda: T.Qwen3MoeConfig(**kv, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                      T.Qwen3MoeForCausalLM),
        "deepseek_v3": (lambda: deepseek_v3_config(num_hidden_layers=6), T.DeepseekV3ForCausalLM),
    }[family]
    return cls(cfg()).eval()


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


def save_tiny_moe(kind: str, path, vocab_size: int = 256) -> str:
    """Save a tiny random ``deepseek_v3`` or ``qwen3_moe`` (8 layers, fp32) to ``path``; returns it."""
    import transformers as T

    torch.manual_seed(0)
    if kind == "deepseek_v3":
        model = T.DeepseekV3ForCausalLM(deepseek_v3_config(8, vocab_size))
    else:
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            max_position_embeddings=2048))
    model.save_pretrained(path)
    return str(path)
