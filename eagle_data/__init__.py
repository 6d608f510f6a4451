"""eagle-data: EAGLE-3 training data from a target model's hidden states.

Public API (heavy modules load lazily):

* :func:`load_index` - the sample index as a ``datasets.Dataset``.
* :mod:`eagle_data.format.schema` - the on-disk schema (version, fields, layer-id convention).
"""

from eagle_data.stream.index import load_index
from eagle_data.format.schema import LAYER_ID_CONVENTION, SCHEMA_VERSION

__version__ = "0.1.0"
__all__ = ["load_index", "SCHEMA_VERSION", "LAYER_ID_CONVENTION"]
