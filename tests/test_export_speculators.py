"""vLLM export (``eagle-data export --format speculators``) proven with the ``speculators`` package's
own loader (0.9.0, installed by scripts/setup.sh with --no-deps: its torch/transformers pins
would replace ours; it runs with ours): through its plain ``SpeculatorModel.from_pretrained(DIR)``
every tensor lands in its parameter, ``embed_tokens`` included (= the target's; it would stay
garbage if the export left it out), and its training-time forward (eager attention, K=3 steps)
drafts exactly our tokens, with nothing copied in by hand. vLLM itself does
not install here: its weight names are checked against the renames of vLLM's
``Eagle3LlamaForCausalLM.load_weights`` / ``LlamaModel.load_weights`` (llama_eagle3.py, read at
vllm-project/vllm@00bd1493), replayed below."""

import json

import pytest
import torch

from train_tiny import TINY_AUX, tiny_module, tiny_target_dir


def _export(tmp_path, **kw):
    from eagle_train.export import export_drafter

    mod = tiny_module(tmp_path)
    d = mod.drafter.float()
    with torch.no_grad():  # every tensor distinct from its init
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export_drafter(d, mod.target_config, TINY_AUX, tmp_path / "export", dtype="float32",
                         format="speculators", verifier=str(tiny_target_dir(tmp_path)), **kw)
    return d, out


def test_config_is_what_vllm_routes_to_its_speculators_path(tmp_path):
    d, out = _export(tmp_path, speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False  # vLLM's default when missing is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [k + 1 for k in TINY_AUX]  # vLLM: input of layer k
    spec = cfg["speculators_config"]
    assert spec["default_proposal_method"] in {m["proposal_type"] for m in spec["proposal_methods"]}
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": str(tiny_target_dir(tmp_path)), "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 256
    assert cfg["draft_vocab_size"] == d.cfg.draft_vocab_size


def _vllm_names(names):
    """The parameter each exported tensor reaches in vLLM's Eagle3LlamaForCausalLM (see module doc)."""
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
               ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add(name.replace("d2t", "draft_id_to_target_id"))
            continue
        if "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        for a, b in stacked.items():
            if a in name:
                name = name.replace(a, b)
                break
        out.add(name)
    return out


def test_weight_names_reach_every_vllm_parameter(tmp_path):
    from safetensors.torch import load_file

    _, out = _export(tmp_path)
    sd = load_file(str(out / "model.safetensors"))
    layer = "model.layers.0."
    want = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
            layer + "self_attn.qkv_proj.weight", layer + "self_attn.o_proj.weight",
            layer + "mlp.gate_up_proj.weight", layer + "mlp.down_proj.weight", layer + "input_layernorm.weight",
            layer + "hidden_norm.weight", layer + "post_attention_layernorm.weight", "model.embed_tokens.weight"}
    # model.embed_tokens: shipped for speculators' loader; vLLM's proposer drops it for the target's when equal
    assert _vllm_names(sd) == want
    assert all(k.startswith(("fc.", "layers.0.", "norm.", "lm_head.")) or k in ("d2t", "t2d", "embed_tokens.weight")
               for k in sd)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * 64)  # [embeds | hidden] input


def test_speculators_loader_takes_every_tensor_and_drafts_our_tokens(tmp_path):
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from eagle_train.model import load_target_tensors

    d, out = _export(tmp_path)
    target_embed = load_target_tensors(tiny_target_dir(tmp_path), ["model.embed_tokens.weight"])
    target_embed = target_embed["model.embed_tokens.weight"].float()
    ours = {k.replace("midlayer.", "layers.0."): v for k, v in d.export_state_dict().items()}
    ours["embed_tokens.weight"] = target_embed
    # the call a speculators user makes, nothing patched: every tensor in its place, and the
    # embedding the target's (speculators fills it from the verifier only where it is NaN, and
    # transformers has already filled it, so an export without it loads garbage, silently)
    plain = SpeculatorModel.from_pretrained(str(out))
    assert type(plain).__name__ == "Eagle3DraftModel"
    assert torch.equal(plain.embed_tokens.weight.float(), target_embed)
    theirs = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    for k, v in ours.items():
        assert torch.equal(theirs[k], v.to(theirs[k].dtype)), k
    assert plain.config.eagle_aux_hidden_state_layer_ids == [k + 1 for k in TINY_AUX]
    # the same call with eager attention (its default flex path fails on CPU), for its forward
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "eager"
    m = SpeculatorModel.from_pretrained(str(out), config=cfg).float().eval()
    assert torch.equal(m.embed_tokens.weight, target_embed)
    torch.manual_seed(0)
    t = 40
    ids, aux = torch.randint(0, 256, (1, t)), torch.randn(1, t, 3 * 64)
    with torch.no_grad():
        toks = m(aux, ids, torch.zeros(1, t, dtype=torch.long), position_ids=torch.arange(t)[None], ttt_steps=3)
        hs = d.ttt_forward(ids, aux, torch.ones(1, t, dtype=torch.bool), steps=3)
    for k in range(3):  # rows past T - k read padding tokens in both, compared too
        assert torch.equal(toks[k], d.logits(hs[k]).argmax(-1)), k


def test_export_arguments_are_checked_before_anything_is_written(tmp_path):
    from eagle_train.export import export_drafter

    mod = tiny_module(tmp_path)
    args = (mod.drafter, mod.target_config, TINY_AUX)
    for kw, msg in (({"format": "sglang", "speculative_tokens": 3}, "belong to the speculators"),
                    ({"format": "speculators", "verifier": " "}, "verifier must name the target"),
                    ({"format": "speculators", "speculative_tokens": 0}, "speculative_tokens must be >= 1"),
                    ({"format": "speculators", "dtype": "int8"}, "dtype must be one of"),
                    ({"format": "vllm"}, "export format must be")):
        with pytest.raises(ValueError, match=msg):
            export_drafter(*args, tmp_path / "out", **kw)
        assert not (tmp_path / "out").exists()
