"""Capture backends behind one small Protocol (:class:`eagle_data.engines.base.Backend`).

Heavy imports (transformers, sglang) live only inside their backend module.
"""

import dataclasses
import inspect
import sys

from eagle_data.checks import BACKEND_OPTIONS_SET_BY_RUN, check_option_types
from eagle_data.engines.base import Backend, BackendInfo, Captured, default_aux_layer_ids, validate_aux_layer_ids



def make_backend(name: str, **kwargs) -> Backend:
    """Build a backend by name: ``"hf"`` (reference) or ``"sglang"`` (production).

    Raises:
        ValueError: unknown backend, options it does not take (``backend_kwargs``), the sglang
            extra not installed, or a model folder whose weights cannot be loaded.
    """
    if name == "hf":
        from eagle_data.engines.hf import HFBackend as cls
    elif name == "sglang":
        import importlib.util

        # found, not imported: the CPU engine's environment must be set before sglang loads
        if "sglang" in sys.modules:
            found = sys.modules["sglang"] is not None
        else:
            try:
                found = importlib.util.find_spec("sglang") is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            raise ValueError("backend 'sglang' needs the sglang extra: pip install -e '.[sglang]' "
                             "(no module named 'sglang')")
        from eagle_data.engines.sglang import SGLangBackend as cls
    else:
        raise ValueError(f"unknown backend {name!r}; choose 'hf' or 'sglang'")
    options = getattr(cls, "OPTIONS", None)  # a backend whose knobs are one dataclass (SGLang)
    hints = {k: p.annotation for k, p in inspect.signature(cls).parameters.items() if k != "options"}
    if options is not None:
        hints.update({f.name: f.type for f in dataclasses.fields(options)})
    unknown = sorted(k for k in kwargs if k not in hints or k.startswith("_"))
    if unknown:
        takes = sorted(k for k in hints if not k.startswith("_") and k not in BACKEND_OPTIONS_SET_BY_RUN)
        renamed = "".join(f"; {k} is now {RENAMED[k]}" for k in unknown if k in RENAMED)
        raise ValueError(f"backend_kwargs: the {name} backend takes no option(s) {unknown}{renamed}; it takes {takes}")
    check_option_types(f"backend_kwargs of the {name} backend", kwargs, hints)
    if options is None:
        return cls(**kwargs)
    fields = {f.name for f in dataclasses.fields(options)}
    knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    return cls(**kwargs, options=options(**knobs))


#: backend options that were renamed -> what to give instead
RENAMED = {"max_inflight_tokens": "max_inflight_bytes (bytes of stored rows in flight, not tokens)"}

__all__ = ["Backend", "BackendInfo", "Captured", "default_aux_layer_ids", "validate_aux_layer_ids",
           "make_backend"]
