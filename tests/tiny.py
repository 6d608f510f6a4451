"""Shared tiny random Llama for exactness tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.tiny_targets import deepseek_v3_config, save_tiny_target  # noqa: F401 (tests import them here)

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
