"""Shared tiny random Llama for exactness tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

AUX = [1, 3, 5]


def tiny_llama(seed: int = 0, vocab: int = 600) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()
