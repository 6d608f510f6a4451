"""eagle-data: EAGLE-3 training data from a target model's hidden states.

Public API (loaded on first use: the command line starts without torch):

* :func:`load_index` - the sample index as a ``datasets.Dataset``.
* :mod:`eagle_data.format.schema` - the on-disk schema (version, fields, layer-id convention).
"""

__version__ = "0.1.0"
__all__ = ["load_index", "SCHEMA_VERSION", "LAYER_ID_CONVENTION"]


def __getattr__(name: str):
    if name == "load_index":
        from eagle_data.stream.index import load_index

        return load_index
    if name in ("SCHEMA_VERSION", "LAYER_ID_CONVENTION"):
        from eagle_data.format import schema

        return getattr(schema, name)
    raise AttributeError(f"module 'eagle_data' has no attribute {name!r}")
