"""Test helpers: the shared real chat templates and an offline byte-level BPE tokenizer."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Real chat templates of the major families, byte-exact copies with their sources (SOURCES.md),
# shipped as package data (eagle_data/templates; `--chat_template NAME`).
TEMPLATES_DIR = Path(os.environ.get("EAGLE_DATA_TEMPLATES", REPO / "eagle_data" / "templates"))

# bos/eos per family as listed in shared/chat_templates/SOURCES.md
BOS_EOS = {
    "deepseek": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "gemma": ("<bos>", "<eos>"),
    "glm4": (None, "<|endoftext|>"),
    "gpt_oss": ("<|startoftext|>", "<|return|>"),
    "gptoss": ("<|startoftext|>", "<|return|>"),
    "kimi": ("[BOS]", "[EOS]"),
    "lfm2": ("<|startoftext|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"),
    "phi3": ("<s>", "<|endoftext|>"),
    "phi4": ("<|endoftext|>", "<|im_end|>"),
    "qwen": (None, "<|im_end|>"),
    "smollm": (None, "<|im_end|>"),
}
_MARKERS = re.compile(r"<\|[^|<>\s]+\|>|<｜[^｜]+｜>|<(?:start|end)_of_(?:turn|image)>|\[/?[A-Z_]{3,}\]")


def template_files() -> list[Path]:
    return sorted(TEMPLATES_DIR.glob("*.jinja"))


def bos_eos(name: str) -> tuple[str | None, str]:
    key = name.removeprefix("trl_")
    for k, v in BOS_EOS.items():
        if key.startswith(k):
            return v
    raise KeyError(name)


@lru_cache(maxsize=1)
def _base_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Hello there, how are you? I am fine, thank you. The quick brown fox jumps over the lazy dog.",
        "Summarize the main ideas into bullet points. Here are the main ideas: 1. Identify 2. Plan",
        "def add(a, b):\n    return a + b\n", "Café, naïve, 日本語のテキスト, Ελληνικά, emoji 🙂",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def family_tokenizer(template_path: Path):
    """A fast tokenizer whose special tokens are the template's markers + its bos/eos."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    text = template_path.read_text(encoding="utf-8")
    bos, eos = bos_eos(template_path.stem)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_base_tokenizer_json()),
                                  bos_token=bos, eos_token=eos)
    markers = sorted(set(_MARKERS.findall(text)) - {None, bos, eos})
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = text
    return tok
