"""``eagle-data vocab|train|eval|export|demo|serve-check``: drafter training and serving checks (``eagle_train``)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union


def vocab(path: str, size: int = 32000, out: Optional[str] = None, rebuild: bool = False,
          exclude_keys: Optional[str] = None) -> None:
    """Build the draft vocabulary (d2t/t2d) from the index histogram of supervised tokens.

    Rule: higher count first, ties to the lower token id; fewer than SIZE distinct tokens are
    filled with the lowest unused ids; draft ids follow ascending target ids. The file records
    what it was built from (dataset, size, excluded keys); an existing file built from anything
    else is refused, not reused: pass --rebuild to overwrite it.

    Args:
        path: dataset directory (index.parquet + manifest.json).
        size: draft vocabulary size N.
        out: output safetensors file (default: draft_vocab_{size}.safetensors in the current
            directory; the dataset directory is only read).
        rebuild: recompute and overwrite the output if it exists (otherwise it is reused when
            built from the same dataset, size and excluded keys, and refused when not).
        exclude_keys: JSON file holding a list of sample keys not to count (a held-out split);
            every key must be in the dataset's index.
    """
    from eagle_train.vocab import build_vocab, read_key_list, vocab_file_name

    ex = read_key_list(exclude_keys, "--exclude_keys") if exclude_keys else None
    d2t, t2d, p = build_vocab(path, size, out=out or vocab_file_name(size), rebuild=rebuild, exclude_keys=ex)
    print(p)


def train(model: Optional[dict[str, Any]] = None, data: Optional[Union[dict[str, Any], str]] = None,
          trainer: Optional[dict[str, Any]] = None, seed_everything: int = 0,
          ckpt_path: Optional[str] = None) -> None:
    """Train an EAGLE-3 drafter; every option: python -m eagle_train.cli fit --help.

    The sections are LightningCLI's (see configs/train/*.yaml); the command above lists each
    --model.*, --data.* and --trainer.* option with its type, default and doc.

    Args:
        model: eagle_train.module.EagleDrafterModule arguments (e.g. --model.lr 3e-4; grouped
            ones as --model.loss.ttt_steps 5 or, alike, --model.ttt_steps 5).
        data: eagle_data.stream.datamodule.EagleDataModule arguments (e.g. --data.batch_size 4), or a
            YAML file of them (--data configs/datamodule.yaml).
        trainer: lightning Trainer arguments (e.g. --trainer.max_steps 100, --trainer.strategy ddp).
        seed_everything: global seed.
        ckpt_path: resume from this checkpoint ("last": the run's newest).
    """
    from eagle_train.cli import fit

    print(fit({"model": model, "data": data, "trainer": trainer, "seed_everything": seed_everything}, ckpt_path))


def model_group_fields(argv: list[str]) -> list[str]:
    """``eagle-data train``'s ``--model.<group>.<field>`` options as ``--model.<field>``. The
    model section is a plain dict here, in which jsonargparse would replace a config's whole
    ``<group>`` by the one field given; :func:`eagle_train.cli.fit` puts the field back into its
    group (:func:`eagle_train.options.nest_groups`), beside the config's others, and so does
    :func:`grouped_print_config` for ``--print_config``."""
    if not argv or argv[0] != "train":
        return argv
    from eagle_train.options import GROUPS

    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        parts = name.split(".")
        out.append(f"--model.{parts[2]}{eq}{value}" if len(parts) == 3 and parts[0] == "--model"
                   and parts[1] in GROUPS else arg)
    return out


def train_option_problem(argv: list[str]) -> Optional[str]:
    """One line naming the first ``--model.*``, ``--data.*`` or ``--trainer.*`` option of
    ``eagle-data train`` that its section does not take, with the closest it does
    (:func:`eagle_train.option_names.unknown_option`: read from the classes' sources, before torch
    loads), or that would lose the config's settings silently here (:func:`_unmerged`); None if
    there is none (a config file's keys: LightningCLI checks them)."""
    if not argv or argv[0] != "train":
        return None
    from eagle_train.option_names import unknown_option

    names = [a[2:].partition("=")[0] for a in argv[1:_options_end(argv)] if a.startswith("--")]
    for name in names:
        if name.partition(".")[0] in ("model", "data", "trainer"):
            if (typo := unknown_option(name)) is not None:
                return f"eagle-data train: {typo} (every option: python -m eagle_train.cli fit --help)"
            if (merge := _unmerged(name, names)) is not None:
                return f"eagle-data train: {merge}; or run python -m eagle_train.cli fit, which merges them"
    return None


def _options_end(argv: list[str]) -> int:
    """Where ``argv``'s options end (a ``--`` or the end)."""
    return argv.index("--") if "--" in argv else len(argv)


def _unmerged(name: str, names: list[str]) -> Optional[str]:
    """Why ``--NAME`` would lose settings silently here, where each section is a plain dict that
    jsonargparse replaces or extends key by key (None: it would not): a list append inside a
    section, an option two levels into ``--data``/``--trainer``, a section given whole beside its
    own options."""
    section, _, rest = name.partition(".")
    if rest and name.endswith("+"):
        return f"--{name} would replace the config's list, not append to it: give the whole list"
    if section in ("data", "trainer") and rest.count(".") > 0:
        return f"--{name} would replace the config's whole {rest.partition('.')[0]!r}: give it whole"
    if not rest and any(n.startswith(section + ".") for n in names):
        return f"--{section} given whole and --{section}.<option> both: the options would replace the whole"
    return None


@contextlib.contextmanager
def grouped_print_config(argv: list[str]) -> Iterator[None]:
    """``eagle-data train --print_config`` shows a group field given on the command line inside its
    group, once: jsonargparse prints the model section as parsed, where ``--model.loss.ttt_steps``
    is flat (:func:`model_group_fields`) beside the config's ``loss``; the printed YAML is read
    back and the field moved into its group as :func:`eagle_train.cli.fit` does
    (:func:`eagle_train.options.nest_groups`). Other commands and runs: untouched."""
    if not argv or argv[0] != "train" or not any(a.partition("=")[0] == "--print_config" for a in argv):
        yield
        return
    import io

    import yaml

    from eagle_train.options import nest_groups

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        text = printed.getvalue()
        try:
            cfg = yaml.safe_load(text)
        except yaml.YAMLError:
            cfg = None
        if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
            text = yaml.safe_dump({**cfg, "model": nest_groups(cfg["model"])}, default_flow_style=False,
                                  allow_unicode=True, sort_keys=False)
        sys.stdout.write(text)


def evaluate(path: str, checkpoint: str, out: str = "out/eval", heldout_keys: Optional[str] = None,
             heldout_fraction: Optional[float] = None, num_samples: int = 16, positions_per_sample: int = 8,
             steps: int = 7, compare_untrained: bool = True, target_model: Optional[str] = None,
             max_length: Optional[int] = None, device: Optional[str] = None, prompt_lookup_max: int = 4) -> None:
    """Acceptance length tau of a drafter vs the HF target on held-out samples, beside prompt lookup.

    tau = 1 + the mean accepted prefix of greedy draft chains (eagle_train.evaluate);
    prompt-lookup (n-gram) speculation is scored on the same positions: the free baseline to beat.

    Args:
        path: dataset directory holding the held-out samples.
        checkpoint: Lightning checkpoint of the drafter.
        out: output directory (acceptance.json, acceptance.png).
        heldout_keys: JSON list of held-out sample keys (default: the keys the checkpoint records its
            training left out (--model.exclude_keys), else a deterministic index split of ``path``,
            with a warning: nothing checks that the drafter did not train on those samples). Keys
            given here that the checkpoint does not record as left out are warned about.
        heldout_fraction: score a deterministic index split of this fraction of ``path``'s keys
            (1.0 for a held-out set extracted apart from the training data), also when the
            checkpoint records held-out keys (warned: unchecked against the training data);
            default: the recorded keys, else 0.1. Not together with ``heldout_keys``.
        num_samples: evaluate at most this many held-out samples.
        positions_per_sample: draft chains per sample (positions inside assistant spans).
        steps: K draft tokens per chain.
        compare_untrained: also evaluate the same drafter at initialisation.
        target_model: target HF folder (default: the checkpoint's).
        max_length: truncate held-out samples to this many tokens first.
        device: where the drafter and target run (default: "cuda" when a GPU is visible, else "cpu").
        prompt_lookup_max: longest n-gram prompt lookup tries (vLLM's prompt_lookup_max).
    """
    from eagle_train.evaluate import evaluate as _evaluate

    s = _evaluate(dataset_dir=path, checkpoint=checkpoint, out_dir=out, heldout_keys=heldout_keys,
                  heldout_fraction=heldout_fraction, num_samples=num_samples,
                  positions_per_sample=positions_per_sample, steps=steps, compare_untrained=compare_untrained,
                  target_model=target_model, max_length=max_length, device=device,
                  prompt_lookup_max=prompt_lookup_max)
    print(json.dumps({k: ({"tau": v["tau"], "tau_ci95": v["tau_ci95"], "num_chains": v["num_chains"]}
                          if isinstance(v, dict) and "tau" in v else v)
                      for k, v in s.items() if k != "heldout_keys"}, indent=1))


def export(checkpoint: str, out: str, dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
           format: Literal["sglang", "speculators"] = "sglang",
           verifier: Optional[str] = None, speculative_tokens: Optional[int] = None, overwrite: bool = False,
           target_model: Optional[str] = None, aux_layer_ids: Optional[list[int]] = None) -> None:
    """Export a drafter checkpoint for serving: SGLang or vLLM (speculators format).

    sglang: a LlamaForCausalLMEagle3 folder (--speculative-draft-model-path DIR).
    speculators: the format vLLM serves (vllm serve DIR, or --speculative-config
    '{"model": DIR, "method": "eagle3", ...}' with the target) and the speculators package loads.

    Args:
        checkpoint: Lightning checkpoint of the drafter.
        out: output folder (config.json + model.safetensors).
        dtype: weight dtype: bfloat16, float16 or float32.
        format: "sglang" or "speculators" (vLLM).
        verifier: speculators only: the target's hub name or path written into the config (default:
            the checkpoint's target folder, a path on this machine: give what vLLM will find).
        speculative_tokens: speculators only: draft tokens per step vLLM proposes by default (7).
        overwrite: replace an export already in OUT (otherwise refused).
        target_model: the target's folder, when it moved since training (default: the checkpoint's).
        aux_layer_ids: the target layers the drafter reads, for a checkpoint that records none
            (default: the checkpoint's).
    """
    from eagle_train.export import export_checkpoint

    print(export_checkpoint(checkpoint, out, dtype, aux_layer_ids=aux_layer_ids, format=format, verifier=verifier,
                            speculative_tokens=speculative_tokens, overwrite=overwrite, target_model=target_model))


def demo(path: str, out: str = "out/drafter-demo", minutes: float = 8.0, draft_vocab_size: int = 2048,
         eval_samples: int = 12, target_model: str = "smollm2") -> None:
    """CPU demo of drafter training: draft vocab, train for MINUTES, tau, SGLang and vLLM exports.

    The main job's second half: draft vocab -> train a drafter for MINUTES -> tau of the
    trained and the untrained drafter on held-out conversations (+ PNG plot) -> SGLang and vLLM exports.

    Args:
        path: dataset directory written by `eagle-data extract`.
        out: output directory (checkpoint, demo_summary.json, acceptance.png, sglang_drafter/,
            vllm_drafter/).
        minutes: training wall time (> 0).
        draft_vocab_size: N (>= 1).
        eval_samples: held-out samples evaluated at most (>= 1).
        target_model: "smollm2" (embedded default) or the target's HF folder.
    """
    from eagle_train.pipeline import demo as _demo

    _demo(path, out, minutes=minutes, draft_vocab_size=draft_vocab_size, eval_samples=eval_samples,
          target_model=target_model)  # prints its summary
    print(f"every figure: {Path(out) / 'demo_summary.json'}")


def serve_check(drafter: str, data: str, target: Optional[str] = None, heldout_keys: Optional[str] = None,
                heldout_fraction: float = 0.1, num_prompts: int = 8, max_prompt_tokens: int = 384,
                prompt_turn: Literal["first", "last"] = "last", max_new_tokens: int = 64, steps: int = 7,
                dtype: str = "float32", device: str = "cpu", attention_backend: Optional[str] = None,
                speed_batches: Optional[list[int]] = None, ngram: bool = False, out: str = "out/serve-check") -> None:
    """Serve an exported drafter with SGLang's EAGLE-3 speculative decoding: engine tau vs offline tau.

    Chain drafting; the engine's tau is compared with the offline tau of the same drafter on the
    same text. Three greedy runs over held-out prompts: the target alone (plain SGLang), target + drafter
    (speculative SGLang: the engine counts verify steps and accepted drafts), and the offline
    replay of the same chains with the folder read back into the project's drafter. Prints and
    writes OUT/serve_check.json: engine and offline tau with per-position acceptance, how many
    outputs equal plain greedy, and per prompt whether engine and replay agree within one chain.
    Needs the sglang extra; on CPU it runs with eagle-data's stand-in kernels (fp32 recommended:
    in bf16 the verify pass rounds differently from one-token decode).

    Args:
        drafter: folder written by `eagle-data export` (SGLang format).
        data: dataset directory; prompts are held-out samples' contexts up to an assistant reply.
        target: the target's HF folder ("smollm2": the embedded default; default: the dataset
            manifest's model_path).
        heldout_keys: JSON list of sample keys to take prompts from (e.g. the demo's
            heldout_keys.json; default: the deterministic index split of ``heldout_fraction``, as eval).
        heldout_fraction: without ``heldout_keys``: the fraction of the dataset's keys held out by
            eval's deterministic index split (1.0: a dataset that is held out as a whole).
        num_prompts: prompts at most (>= 1).
        max_prompt_tokens: a prompt ends at the start of an assistant reply within this many tokens.
        prompt_turn: which reply the prompt ends before: "first" (the conversation's opening
            user turn(s), as a chat starts) or "last" (the last reply starting within
            ``max_prompt_tokens``: the most context).
        max_new_tokens: tokens generated per prompt.
        steps: draft tokens per verify step K (speculative_num_steps; K + 1 verified).
        dtype: engine dtype (float32 or bfloat16).
        device: "cpu" or "cuda".
        attention_backend: SGLang attention backend (default: SGLang's choice on GPU, e.g. "triton" or
            "flashinfer" where FA3 is not installed; CPU: intel_amx, the one with speculative decoding).
        speed_batches: decode tokens/s, plain vs speculative, at each of these batch sizes (e.g.
            ``[1, 32]``; batch 1: the first 8 prompts one at a time; batch b: the first b prompts
            together), on the engines of the check (on a GPU with SGLang's decode CUDA graphs).
        ngram: also run SGLang's own NGRAM speculation (free: drafts from the text it has seen; the
            same steps + 1 tokens verified per step, as a chain) on the same prompts, each engine
            fresh: its engine tau with a 95 % interval over prompts beside the drafter's, and its
            decode speed at ``speed_batches``.
        out: output folder for serve_check.json (serve_check.partial.json meanwhile: each engine's figures).
    """
    from eagle_train.serve_check import SERVE_PARTIAL, fresh_serve_out, run_serve_check

    _check_serve_args(num_prompts, max_prompt_tokens, max_new_tokens, steps, dtype, device, speed_batches, out,
                      heldout_fraction, prompt_turn)
    o = fresh_serve_out(out)
    target_path, exported, prompts, used = _serve_prompts(drafter, data, target, heldout_keys, heldout_fraction,
                                                           num_prompts, max_prompt_tokens, prompt_turn == "first")
    res = run_serve_check(target_path, drafter, prompts, steps=steps, max_new_tokens=max_new_tokens,
                          dtype=dtype, device=device, exported=exported, speed_batches=speed_batches or (), ngram=ngram,
                          engine_kw={"attention_backend": attention_backend} if attention_backend else None,
                          partial=o / SERVE_PARTIAL)
    (o / "serve_check.json").write_text(json.dumps({**res, "prompt_keys": used}, indent=1))
    (o / SERVE_PARTIAL).unlink(missing_ok=True)
    print(serve_check_summary(res), o / "serve_check.json", sep="\n")


def _check_serve_args(num_prompts: int, max_prompt_tokens: int, max_new_tokens: int, steps: int, dtype: str,
                      device: str, speed_batches: Optional[list[int]], out: str, heldout_fraction: float,
                      prompt_turn: str) -> None:
    """:func:`serve_check`'s settings, checked before anything is read or started (ValueError)."""
    from eagle_data.checks import check_device, check_positive

    if not 0 < heldout_fraction <= 1:
        raise ValueError(f"heldout_fraction must be in (0, 1], got {heldout_fraction}")
    if prompt_turn not in ("first", "last"):
        raise ValueError(f"prompt_turn must be first or last, got {prompt_turn!r}")

    check_positive(num_prompts=num_prompts, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                   steps=steps)
    for b in speed_batches or []:
        check_positive(speed_batches=b)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    check_device(device)  # "cuda" without a GPU: refused here, not by the engine's scheduler
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out!r} exists and is not a directory (serve_check.json is written into it)")
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise ValueError("serve-check needs the sglang extra: pip install -e '.[sglang]' (or bash scripts/setup.sh "
                         "dev,sglang)")


def _serve_prompts(drafter: str, data: str, target: Optional[str], heldout_keys: Optional[str], fraction: float,
                   num_prompts: int, max_prompt_tokens: int, first: bool) -> tuple[str, Any, list, list[str]]:
    """The target's folder, the exported drafter (read back) and the held-out prompts (with their keys)
    of :func:`serve_check`.

    Raises:
        ValueError: no target folder, a bad export, no held-out key, or no prompt within the limit.
    """
    from eagle_data.format.records import read_manifest
    from eagle_train.heldout import heldout_split
    from eagle_train.export import load_exported_drafter
    from eagle_train.model import resolve_model_path
    from eagle_train.serve_check import heldout_prompts
    from eagle_train.vocab import read_key_list

    manifest = read_manifest(data)
    target_path = str(resolve_model_path(target or manifest["model_path"]))
    if not (Path(target_path) / "config.json").is_file():
        raise ValueError(f"target {target_path!r} is not a model folder (no config.json); give the HF folder of "
                         f"the target with --target")
    exported = load_exported_drafter(drafter, target_path)  # refuses a bad folder before anything is read or started
    keys = read_key_list(heldout_keys, "--heldout_keys") if heldout_keys else heldout_split(data, fraction)
    if not keys:
        raise ValueError(f"--heldout_keys {heldout_keys!r} holds no keys")
    prompts, used = heldout_prompts(data, keys, max_prompt_tokens, num_prompts, first=first)
    if not prompts:
        raise ValueError(f"{data}: none of the {len(keys)} held-out samples has an assistant reply starting "
                         f"within max_prompt_tokens={max_prompt_tokens}")
    if len(prompts) < num_prompts:
        why = (f"only {len(keys)} held-out sample(s)" if len(keys) <= len(prompts) else
               f"the other {len(keys) - len(prompts)} held-out sample(s) have no assistant reply starting within "
               f"max_prompt_tokens={max_prompt_tokens}")
        print(f"serve-check: {len(prompts)} prompt(s) of the {num_prompts} asked for: {why}", file=sys.stderr)
    return target_path, exported, prompts, used


def _interval(acceptance: dict[str, Any]) -> str:
    iv = acceptance.get("interval")
    return f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else ""


def serve_check_summary(res: dict[str, Any]) -> str:
    """A few lines of :func:`~eagle_train.serve_check.run_serve_check`'s result (the file has all)."""
    n = res["num_prompts"]
    lines = [f"serve-check ({res['dtype']}, {n} prompts, {res['steps']} draft steps): engine tau "
             f"{res['engine']['tau']:.3f}{_interval(res['engine'])}, offline replay of the same drafts "
             f"{res['offline']['tau']:.3f}; within one chain of the replay: {res['within_one_chain']}/{n}; "
             f"speculative output equal to plain greedy: {res['equal_to_plain']}/{n}"]
    if "ngram" in res:
        g = res["ngram"]
        lines.append(f"SGLang NGRAM, the same {res['steps'] + 1} tokens verified per step: engine tau {g['tau']:.3f}"
                     f"{_interval(g)}; output equal to plain greedy: {g['equal_to_plain']}/{n}")
    for p in res.get("speed", ()):
        ng = f", NGRAM {p['ngram_tokens_per_s']:.0f} tok/s ({p['ngram_speedup']:.2f}x)" if "ngram_speedup" in p else ""
        lines.append(f"decode at batch {p['batch']}: plain {p['plain_tokens_per_s']:.0f} tok/s, speculative "
                     f"{p['speculative_tokens_per_s']:.0f} tok/s ({p['speedup']:.2f}x){ng}")
    return "\n".join(lines)
