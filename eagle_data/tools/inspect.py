"""``eagle-data inspect``: manifest summary + one sample with the loss-masked text highlighted."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from eagle_data.format.records import read_manifest
from eagle_data.format.schema import META_EXT, TENSOR_EXT, check_manifest_compat, decode_tensors
from eagle_data.tools.read_samples import shard_payloads


def read_sample(shard: Path, key: str) -> tuple[dict, dict]:
    """One sample's tensors and metadata from a local shard (one walk of its headers).

    Raises:
        ValueError: the key is not in the shard (or only one of its members is).
    """
    found = shard_payloads(shard, {key}).get(key, {})
    if len(found) != 2:
        raise ValueError(f"{shard}: sample {key} not found (or incomplete)")
    return decode_tensors(found[TENSOR_EXT], where=f"{shard.name}:{key}"), json.loads(found[META_EXT])


def masked_text(tokenizer, input_ids, loss_mask, max_chars: int, brackets: bool = False) -> Text:
    """Decode each run of equal ``loss_mask`` as a whole (a character split over several byte
    tokens, as in Greek, Japanese or emoji, decodes correctly); supervised runs in bold green,
    and with ``brackets`` (output without colours: a file or CI log) also between ``⟦`` and ``⟧``.
    An unsupervised run longer than half of ``max_chars`` (a long prompt) keeps its first and last
    sixth of ``max_chars`` around ``…[N chars]…``, so that the cut does not hide every answer."""
    text = Text()
    ids, mask = input_ids.tolist(), loss_mask.tolist()
    start, keep = 0, max(max_chars // 6, 1)
    while start < len(ids) and len(text) <= max_chars:
        end = start
        while end < len(ids) and mask[end] == mask[start]:
            end += 1
        part = tokenizer.decode(ids[start:end])
        sup = bool(mask[start])
        if not sup and len(part) > max_chars // 2 and len(part) > 2 * keep:
            text.append(part[:keep], style="dim")
            text.append(f" …[{len(part) - 2 * keep} chars]… ", style="red")
            part = part[-keep:]
        if brackets and sup:
            part = f"⟦{part}⟧"
        text.append(part, style="bold green" if sup else "dim")
        start = end
    if len(text) > max_chars:
        text = text[:max_chars]
        text.append(" …[cut]", style="red")
    return text


def pick_sample(idx) -> int:
    """An informative default: the first multi-turn sample (≥ 4 messages) under 1,500 tokens,
    else the first sample."""
    for i, (turns, n) in enumerate(zip(idx["num_turns"], idx["num_tokens"])):
        if turns >= 4 and n <= 1500:
            return i
    return 0


def inspect_dataset(path: str, sample: int | None = None, max_chars: int = 3000, key: str | None = None) -> None:
    from transformers import AutoTokenizer

    from eagle_data.stream.index import load_index

    con = Console()
    m = read_manifest(path)
    check_manifest_compat(m, where=str(path))
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    idx = load_index(path)
    if sample is not None and key is not None:
        raise ValueError("give --sample or --key, not both")
    if len(idx) and sample is not None and not 0 <= sample < len(idx):
        raise ValueError(f"--sample {sample} is out of range: {path} holds {len(idx)} samples (0..{len(idx) - 1})")
    if len(idx) and key is not None:
        pos = {k: i for i, k in enumerate(idx["key"])}
        if key not in pos:
            raise ValueError(f"--key {key!r}: no such sample in {path} ({len(idx)} samples, e.g. {idx['key'][0]!r})")
        sample = pos[key]
    t = Table(title=f"{path}", show_header=False)
    for k in ("schema_version", "model_path", "backend", "dtype", "final_dtype", "final_rows", "compute_dtype",
              "hidden_size", "num_layers",
              "aux_layer_ids", "layer_id_convention", "final_state_norm", "num_samples", "num_tokens",
              "total_bytes", "skip_counts", "note_counts"):
        t.add_row(k, escape(str(m.get(k))))
    t.add_row("shards", f"{len(m['shards'])} ({', '.join(s['name'] for s in m['shards'][:4])}"
                        f"{', …' if len(m['shards']) > 4 else ''})")
    t.add_row("template", escape(str(m.get("config", {}).get("template"))))
    con.print(t)
    if len(idx) == 0:
        con.print("[red]no samples[/]")
        return
    row = idx[pick_sample(idx) if sample is None else sample]
    tensors, meta = read_sample(Path(path) / row["shard"], row["key"])
    con.print(f"[bold]sample[/] {row['key']} from {row['shard']}: {escape(json.dumps(meta))}")
    con.print({k: f"{tuple(v.shape)} {v.dtype}" for k, v in tensors.items()})
    tok = AutoTokenizer.from_pretrained(m["model_path"])
    plain = not con.is_terminal
    legend = "⟦…⟧ = loss_mask 1" if plain else "[bold green]green = loss_mask 1[/], dim = 0"
    con.print(f"[bold]loss-masked text[/] ({legend}):")
    con.print(masked_text(tok, tensors["input_ids"], tensors["loss_mask"], max_chars, brackets=plain))
