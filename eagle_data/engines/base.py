"""The backend Protocol, its result type, and the aux-layer-id convention.

Convention (see :data:`eagle_data.format.schema.LAYER_ID_CONVENTION`): aux id ``k`` is the output
of decoder layer ``k`` (0-based) = HF ``hidden_states[k + 1]``, the meaning of SGLang's
``eagle_aux_hidden_state_layer_ids``. SGLang internally captures the *input* of layer
``k + 1``, which is the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from eagle_data.checks import check_aux_layer_ids


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes bf16 natively (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``),
    from ``/proc/cpuinfo`` (or the text given); ``None`` where that cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = {w for line in cpuinfo.splitlines() if line.split(":")[0].strip() in ("flags", "Features")
             for w in line.partition(":")[2].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def compute_dtype(dtype: str, device: str, native_bf16: bool | None = None) -> str:
    """The dtype a run computes in: ``dtype``, except bf16 on a CPU without native bf16, where
    PyTorch emulates it (4.8x slower than fp32 on an AVX2 CPU, measured): ``"float32"`` then, said
    in a warning; the stored dtype stays what was asked, the manifest records ``compute_dtype``."""
    import logging

    if dtype != "bfloat16" or not str(device).startswith("cpu"):
        return dtype
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    if native is False:
        logging.getLogger(__name__).warning(
            "this CPU has no native bf16 (no avx512_bf16 / amx_bf16): computing in float32, which is "
            "several times faster here than emulated bf16 (stored dtype unchanged; manifest: compute_dtype)")
        return "float32"
    return dtype


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """``[1, L//2 - 1, L - 4]`` (low, middle, high), as in EAGLE-3 / SGLang / SpecForge.

    Raises:
        ValueError: the model is too shallow for three distinct ids (L < 7: L = 6 gives [1, 2, 2]).
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    validate_aux_layer_ids(ids, num_layers)
    return ids


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check three distinct, strictly increasing ids in ``[0, L-1)``.

    The last layer ``L-1`` is excluded: its output before the final norm is not a useful
    aux feature and SGLang refuses to capture it.

    Raises:
        ValueError: naming the problem (count, order, duplicates, range).
    """
    ids = check_aux_layer_ids(ids)
    if ids[-1] >= num_layers - 1:
        raise ValueError(f"aux_layer_ids {ids} out of range [0, {num_layers - 2}] for {num_layers} layers")
    return ids


#: SGLang target classes whose ``set_eagle3_layers_to_capture`` reads the drafter's aux ids as layer
#: *inputs* (``layers_to_capture = ids``) unless the first id is 1 (then ``ids + 1``, our convention):
#: sglang 0.5.17 - 0.5.23, ``models/deepseek_v2.py`` and ``models/glm4_moe_lite.py``; Kimi-K2.5 wraps
#: DeepSeek-V3 as its language model.
INPUT_ID_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                    "Glm4MoeLiteForCausalLM", "KimiK25ForConditionalGeneration"})


def check_served_aux_ids(ids: Sequence[int], architectures: Sequence[str] | None) -> None:
    """Refuse aux ids that SGLang would serve as other states than the ones extracted.

    For the targets in :data:`INPUT_ID_ARCHITECTURES` SGLang captures the outputs of layers ``ids``
    only when ``ids[0] == 1``; otherwise it feeds the drafter the layers' inputs (one layer lower
    each), silently. The default ids start at 1.

    Raises:
        ValueError: naming the architecture, the ids and what to use instead.
    """
    hit = sorted(INPUT_ID_ARCHITECTURES & set(architectures or ()))
    if hit and list(ids) and int(list(ids)[0]) != 1:
        raise ValueError(f"aux_layer_ids {list(ids)}: SGLang serves {hit[0]} with the drafter's aux ids read as "
                         f"layer inputs unless the first id is 1 (models/deepseek_v2.py, set_eagle3_layers_to_capture),"
                         f" so a drafter trained on these states would get others; start the ids at 1 "
                         f"(the default does)")


@dataclass
class BackendInfo:
    """Facts about the target recorded in the manifest."""
    name: str
    model_path: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: str  # "bfloat16" | "float32" | "float16"
    aux_layer_ids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Captured:
    """Hidden states of one sample.

    Attributes:
        key: the sample key it belongs to.
        aux_hidden_states: [T, 3*H], aux layers concatenated low -> high, on CPU.
        hidden_states: [T, H], final post-norm hidden state, on CPU.
        aux_scale, hidden_scale: [T, 3] / [T, 1] float32 when the backend already stored the field
            as fp8 on the device (:mod:`eagle_data.format.fp8`; a non-finite state gives a
            non-finite scale), else None.
        finite: whether every stored value is finite, when the backend checked on its device
            (None: not checked; the host checks).
    """
    key: str
    aux_hidden_states: torch.Tensor
    hidden_states: torch.Tensor
    aux_scale: torch.Tensor | None = None
    hidden_scale: torch.Tensor | None = None
    finite: bool | None = None


@runtime_checkable
class Backend(Protocol):
    """Runs ONE prefill pass per sample and returns aux + final hidden states."""

    info: BackendInfo

    def capture(self, batch: Sequence[tuple[str, torch.Tensor]]) -> list[Captured]:
        """Capture a batch of ``(key, input_ids [T_i] int64)``.

        Returns one :class:`Captured` per input, in input order, with exactly ``T_i`` rows.

        Raises:
            RuntimeError: the engine returned misaligned or missing rows (names the key).
        """
        ...

    def capture_iter(self, batches: Iterable[Sequence[tuple[str, torch.Tensor]]],
                     prefetch: int = 1) -> Iterator[list[Captured]]:
        """:meth:`capture` over many batches, in order, one list per batch.

        Up to ``prefetch`` later batches may already be computing while the caller handles the
        current one (forward of batch i+1 overlaps the device-to-host copy and the shard
        writing of batch i). This is the only capture path the pipeline calls.

        Raises: as :meth:`capture`, at the failing batch.
        """
        ...

    def close(self) -> None:
        """Release the engine (idempotent)."""
        ...
