"""``eagle-data verify --recompute N``: stored samples re-run through the HF reference engine and
compared layer by layer: max relative error per layer (``max|stored - recomputed| / max|recomputed|``)
against ``rtol``; per token (``||stored_t - recomputed_t|| / ||recomputed_t||``: median, p99, max)
and the smallest per-token cosine, beside what the storage dtype alone gives
(:data:`EXPECTED_TOKEN_REL`). fp8 fields are compared against their quantisation bound
(:func:`eagle_data.format.fp8.error_bound` of the recomputed values: ``recompute_bound`` <= 1 means
within it). The samples are chosen and read by :func:`eagle_data.tools.verify.verify_dataset`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from eagle_data.format.final_rows import taught as taught_rows
from eagle_data.format.fp8 import dequantize, error_bound, scale_name

if TYPE_CHECKING:
    from eagle_data.tools.verify import VerifyReport

#: fp8: the quantisation bound relative to a row's max, 2^-4 (eagle_data.format.fp8), + slack
DEFAULT_RTOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "float8_e4m3fn": 2.0 ** -4 + 1e-3}
#: per-token relative error from rounding to the storage dtype alone (unit roundoff / sqrt(3),
#: the RMS of a uniform rounding error): bf16 ~2.3e-3, fp16 ~2.8e-4, fp32 ~3.4e-8. Recomputing in
#: a low-precision compute dtype adds more (another batch composition changes bf16 kernels'
#: accumulation order): per-token errors of 1-8 % in bf16 are normal there, not in fp32.
EXPECTED_TOKEN_REL = {"float32": 2.0 ** -24 / 3 ** 0.5, "float16": 2.0 ** -11 / 3 ** 0.5,
                      "bfloat16": 2.0 ** -8 / 3 ** 0.5, "float8_e4m3fn": 2.0 ** -4 / 3 ** 0.5}


def ids_outside(ids: torch.Tensor, vocab: int) -> str | None:
    """The problem of token ids [T] outside ``[0, vocab)``, or None."""
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        return f"token ids {int(ids.min())}..{int(ids.max())} outside the model's vocabulary [0, {vocab})"
    return None


def stored_values(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Field ``name`` of a decoded sample as float32 (fp8 dequantised with its scales)."""
    sn = scale_name(name)
    return dequantize(t[name], t[sn], torch.float32) if sn in t else t[name].float()


def recompute_pairs(t: dict[str, torch.Tensor], c, aux_ids: list[int]):
    """``(layer name, stored [T, H] f32, recomputed [T, H] f32, fp8 bound or None)`` per layer: the
    recomputed states rounded to the stored dtype (fp8: compared unrounded, against
    :func:`eagle_data.format.fp8.error_bound` of the recomputed values with the stored scales)."""
    h = t["hidden_states"].shape[1]
    out = []
    for field, cols in (("aux_hidden_states", [(f"aux layer {lid}", j) for j, lid in enumerate(aux_ids)]),
                        ("hidden_states", [("final (post-norm)", 0)])):
        a_all, b_all = stored_values(t, field), getattr(c, field).float()
        if a_all.shape[0] != b_all.shape[0]:  # final_rows="taught": the stored rows only
            b_all = b_all[taught_rows(t["loss_mask"])]
        for name, j in cols:
            a, b = a_all[:, j * h:(j + 1) * h], b_all[:, j * h:(j + 1) * h]
            if scale_name(field) in t:
                out.append((name, a, b, error_bound(b, t[scale_name(field)][:, j:j + 1])))
            else:
                out.append((name, a, b.to(t[field].dtype).float(), None))
    return out


def compare(stored: dict[str, dict[str, torch.Tensor]], chosen: list[str], m: dict[str, Any], device: str,
            rtol: float | None, rep: "VerifyReport") -> None:
    """Recompute the decoded samples ``stored`` (key -> tensors; of ``chosen``, those readable) with the
    model, aux ids and compute dtype of manifest ``m``; the errors go into ``rep`` (``recompute*``,
    ``rtol``, ``dtype``; a problem per sample it cannot recompute and per layer over ``rtol``)."""
    from eagle_data.engines.hf import HFBackend

    model_path = m.get("model_path") or m.get("config", {}).get("model_path")
    aux_ids = list(m.get("aux_layer_ids", []))
    try:
        be = HFBackend(model_path, aux_layer_ids=aux_ids, dtype=m.get("compute_dtype", m.get("dtype")),
                       device=device, trust_remote_code=bool(m.get("config", {}).get("trust_remote_code")))
    except Exception as e:  # any load failure is a verification failure, reported not raised
        rep.add("recompute", str(model_path), f"cannot load the reference model: {type(e).__name__}: {e}")
        return
    per_token: dict[str, list[torch.Tensor]] = defaultdict(list)
    cosines: dict[str, list[torch.Tensor]] = defaultdict(list)
    try:
        vocab = be.info.vocab_size
        for key in chosen:
            t = stored.get(key)
            if t is None:
                continue  # unreadable: reported above or among the shard's problems
            if why := ids_outside(t["input_ids"], vocab):
                rep.add("recompute", key, why)
                continue
            (c,) = be.capture([(key, t["input_ids"])])
            for name, a, b, bound in recompute_pairs(t, c, aux_ids):
                err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                rep.recompute[name] = max(rep.recompute.get(name, 0.0), err)
                if bound is not None:  # fp8: the error against the quantisation bound of the recomputed values
                    over = float(((a - b).abs() / bound).max())
                    rep.recompute_bound[name] = max(rep.recompute_bound.get(name, 0.0), over)
                per_token[name].append((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12))
                cosines[name].append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
    finally:
        be.close()
    for name, errs in per_token.items():
        e = torch.cat(errs).double()
        rep.recompute_tokens[name] = {"token_rel_p50": float(e.quantile(0.5)), "token_rel_p99": float(e.quantile(0.99)),
                                      "token_rel_max": float(e.max()),
                                      "min_cosine": float(torch.cat(cosines[name]).min())}
    tol = rtol if rtol is not None else max(DEFAULT_RTOL.get(m.get("compute_dtype"), 5e-2),
                                            DEFAULT_RTOL.get(m.get("dtype"), 5e-2),
                                            DEFAULT_RTOL.get(m.get("final_dtype"), 5e-2))
    rep.rtol, rep.dtype = tol, m.get("dtype")
    for name, err in rep.recompute.items():
        if err > tol:
            rep.add("recompute", name, f"max relative error {err:.3g} > rtol {tol:.3g} over {len(chosen)} sample(s)")
