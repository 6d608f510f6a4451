"""Export round-trip through SGLang 0.5.23's own ``LlamaForCausalLMEagle3`` (CPU, in-process).

Minimum SGLang setup found for constructing the class without an engine: ``ServerArgs`` set
on the runtime context, ``tp_rank``/``pp_rank`` stated with ``get_parallel().override_permanently``,
a 1-process gloo WORLD (``init_distributed_environment`` + ``initialize_model_parallel`` +
``initialize_dp_attention``), and ``rotary_embedding.base._is_cpu = True`` (otherwise the
rope constructor imports ``vllm._custom_ops`` on a CUDA-less host; ``SGLANG_USE_CPU_ENGINE=1``
instead needs the compiled CPU ``sgl_kernel``). ``RadixAttention`` needs a KV pool and an
attention backend, so for the forward check it is replaced by a plain causal attention over
the same q/k/v; everything else (fc, norms with fused residual, qkv/o projections, rope,
gate_up/SiluAndMul/down, final norm, lm_head) is SGLang's code.
"""

import json
import socket
from types import SimpleNamespace

import pytest
import torch

from train_tiny import tiny_module  # noqa: E402

pytestmark = pytest.mark.sglang


def _init_sglang():
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    import torch.distributed as dist
    if dist.is_initialized():
        return
    sa = ServerArgs(model_path="unused", device="cpu")
    get_context().set_server_args(sa)
    get_parallel().override_permanently(tp_rank=0, pp_rank=0)
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel()
    initialize_dp_attention(server_args=sa)
    import sglang.srt.layers.rotary_embedding.base as rb
    rb._is_cpu = True


class _CausalAttn(torch.nn.Module):
    """Stand-in for RadixAttention: q/k/v [T, heads*d] -> causal SDPA -> [T, heads*d]."""

    def __init__(self, nh, nkv, hd):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd

    def forward(self, q, k, v, forward_batch):
        t = q.shape[0]
        q = q.view(t, self.nh, self.hd).transpose(0, 1)
        k = k.view(t, self.nkv, self.hd).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        v = v.view(t, self.nkv, self.hd).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(0, 1).reshape(t, self.nh * self.hd)


def test_export_roundtrip_sglang(tmp_path):
    pytest.importorskip("sglang")
    from safetensors.torch import load_file

    from eagle_train.export import export_drafter

    mod = tiny_module(tmp_path)
    d = mod.drafter.float()
    with torch.no_grad():  # make every tensor distinct from its init
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export_drafter(d, mod.target_config, [1, 3, 5], tmp_path / "export", dtype="float32")
    cfg_d = json.loads((out / "config.json").read_text())
    assert cfg_d["architectures"] == ["LlamaForCausalLMEagle3"] and cfg_d["num_hidden_layers"] == 1
    assert cfg_d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg_d["draft_vocab_size"] == d.cfg.draft_vocab_size and cfg_d["vocab_size"] == 256
    sd = load_file(str(out / "model.safetensors"))
    assert not any("embed_tokens" in k for k in sd)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(sd)

    _init_sglang()
    from transformers import LlamaConfig
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    cfg = LlamaConfig.from_pretrained(str(out))
    sg = LlamaForCausalLMEagle3(cfg)
    params = dict(sg.named_parameters())
    calls = []
    with torch.no_grad():
        for name, p in params.items():
            p.fill_(float("nan"))
            orig = getattr(p, "weight_loader", None)

            def rec(param, w, *shard, _n=name, _o=orig):
                calls.append((_n, shard))
                if _o is None:
                    param.data.copy_(w)
                else:
                    _o(param, w, *shard)
            p.weight_loader = rec
    sg.load_weights(list(sd.items()))
    # every exported float tensor was consumed exactly once (d2t -> hot_token_id, t2d skipped)
    assert len(calls) == len(sd) - 2, calls
    assert torch.equal(sg.hot_token_id, d.target_ids())
    # every SGLang parameter except the shared target embedding is filled and equals ours
    sg.model.embed_tokens.weight.data.copy_(d.embed_tokens)
    for name, p in params.items():
        assert not torch.isnan(p[: cfg.draft_vocab_size] if name == "lm_head.weight" else p).any(), name
    lay, mine = sg.model.layers[0], d.midlayer
    a = mine.self_attn
    assert torch.equal(sg.model.fc.weight, d.fc.weight)
    assert torch.equal(lay.self_attn.qkv_proj.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert torch.equal(lay.self_attn.o_proj.weight, a.o_proj.weight)
    assert torch.equal(lay.mlp.gate_up_proj.weight, torch.cat([mine.mlp.gate_proj.weight, mine.mlp.up_proj.weight]))
    assert torch.equal(lay.mlp.down_proj.weight, mine.mlp.down_proj.weight)
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        assert torch.equal(getattr(lay, n).weight, getattr(mine, n).weight), n
    assert torch.equal(sg.model.norm.weight, d.norm.weight)
    assert torch.equal(sg.lm_head.weight[: cfg.draft_vocab_size], d.lm_head.weight)

    # one forward (draft extend over T rows): SGLang's fc + midlayer + norm + lm_head vs ours
    torch.manual_seed(0)
    T = 11
    ids = torch.randint(0, 256, (T,))
    aux = torch.randn(T, 3 * 64)
    lay.self_attn.attn = _CausalAttn(lay.self_attn.num_heads, lay.self_attn.num_kv_heads, lay.self_attn.head_dim)
    fb = SimpleNamespace(mm_input_embeds=None, spec_info=SimpleNamespace(hidden_states=aux),
                         forward_mode=SimpleNamespace(is_extend=lambda: False, is_draft_extend_v2=lambda: False),
                         contains_mm_inputs=lambda: False)
    with torch.no_grad():
        h_logits, (h_aux,) = sg.model(ids, torch.arange(T), fb)
        sg_logits = h_logits @ sg.lm_head.weight[: cfg.draft_vocab_size].T
        (ours,) = d.ttt_forward(ids[None], aux[None], torch.ones(1, T, dtype=torch.bool), steps=1)
    torch.testing.assert_close(h_aux, ours[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sg_logits, d.logits(ours)[0], rtol=1e-4, atol=1e-4)
