"""Capture backends behind one small Protocol (:class:`eagle_data.extract.backends.base.Backend`).

Heavy imports (transformers, sglang) live only inside their backend module.
"""

from eagle_data.extract.backends.base import Backend, BackendInfo, Captured, default_aux_layer_ids, validate_aux_layer_ids


def make_backend(name: str, **kwargs) -> Backend:
    """Build a backend by name: ``"hf"`` (reference) or ``"sglang"`` (production)."""
    if name == "hf":
        from eagle_data.extract.backends.hf import HFBackend
        return HFBackend(**kwargs)
    if name == "sglang":
        from eagle_data.extract.backends.sglang import SGLangBackend
        return SGLangBackend(**kwargs)
    raise ValueError(f"unknown backend {name!r}; choose 'hf' or 'sglang'")


__all__ = ["Backend", "BackendInfo", "Captured", "default_aux_layer_ids", "validate_aux_layer_ids",
           "make_backend"]
