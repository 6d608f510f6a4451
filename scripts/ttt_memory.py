"""Peak GPU memory and step time of one drafter training step (bf16 autocast, AdamW), one batch of
``B x T`` tokens, K = 7, for an 8B-shaped drafter (H 4096, 32/8 heads, head_dim 128, I 14336,
draft vocab 32k, target vocab 128k), random weights and data, every token supervised.

    python scripts/ttt_memory.py --impl flex --T 8192     # flex | chunked | old (dense reference)
    python scripts/ttt_memory.py --small --T 64           # CPU smoke test (tiny sizes, no memory figures)

Prints one ``RESULT {...}`` JSON line: per-step seconds (the first includes torch.compile), peak
allocated / reserved GiB of the last step, and the memory held before it (weights, Adam state,
frozen target embedding and head).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from eagle_train import attention  # noqa: E402
from eagle_train.loss import ttt_loss  # noqa: E402
from eagle_train.model import DraftConfig, Eagle3Drafter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="flex", choices=["flex", "chunked", "old"])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--small", action="store_true", help="tiny sizes on the CPU")
    a = p.parse_args()
    dev = torch.device("cpu" if a.small else "cuda")
    H, N, V, inter, nh, nkv = (64, 48, 256, 128, 4, 2) if a.small else (4096, 32000, 128256, 14336, 32, 8)
    cfg = DraftConfig(hidden_size=H, intermediate_size=inter, num_attention_heads=nh, num_key_value_heads=nkv,
                      head_dim=H // nh, vocab_size=V, draft_vocab_size=N, target_hidden_size=H)
    torch.manual_seed(0)
    with torch.device(dev):
        d = Eagle3Drafter(cfg, torch.randn(V, H) * 0.02, torch.zeros(N, dtype=torch.long), torch.arange(V) < N)
        head = torch.randn(V, H) * 0.02
    opt = torch.optim.AdamW(d.parameters(), lr=1e-5)
    g = torch.Generator(device=dev).manual_seed(0)
    B, T = a.B, a.T
    batch = {"input_ids": torch.randint(0, V, (B, T), device=dev, generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.bool, device=dev),
             "loss_mask": torch.ones(B, T, dtype=torch.bool, device=dev),
             "aux_hidden_states": torch.randn(B, T, 3 * H, device=dev, generator=g).bfloat16(),
             "hidden_states": torch.randn(B, T, H, device=dev, generator=g).bfloat16()}
    if a.impl == "chunked":
        attention._flex_state["broken"] = True  # "auto" then takes the chunked attention
    if a.impl == "old":
        from test_ttt_attention import ttt_loss_reference as fn
    else:
        fn = ttt_loss
    cuda = dev.type == "cuda"
    res = {"impl": a.impl, "B": B, "T": T, "params_M": round(sum(x.numel() for x in d.parameters()) / 1e6, 1),
           "step_s": []}
    for _ in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            res["held_before_step_GiB"] = round(torch.cuda.memory_allocated() / 2 ** 30, 2)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = fn(d, head, batch, steps=7, exclude_oov=True)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        res["step_s"].append(round(time.perf_counter() - t0, 3))
        res["loss"] = round(float(out["loss"].detach()), 4)
    if cuda:
        res["peak_allocated_GiB"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        res["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2 ** 30, 2)
    res["flex_fell_back"] = attention._flex_state["broken"] and a.impl != "chunked"
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
