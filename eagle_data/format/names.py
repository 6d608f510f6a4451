"""The on-disk names a configuration may give or a source's tag must fit, without torch: the
command line checks them before it loads anything heavy. :mod:`eagle_data.format.schema` and
:mod:`eagle_data.format.final_rows` build on them (declared here only)."""

#: hidden-state (compute) dtypes: a run computes in one and may store it
HIDDEN_DTYPE_NAMES = ("bfloat16", "float32", "float16")
#: hidden-state dtypes a shard may store (the compute dtypes + fp8 with scales)
STORAGE_DTYPE_NAMES = (*HIDDEN_DTYPE_NAMES, "float8_e4m3fn")
#: the layouts of ``hidden_states``: every row, or only the taught rows
FINAL_ROWS = ("all", "taught")

#: a shard member's tensor file extension (``KEY.safetensors``)
TENSOR_EXT = "safetensors"
#: a shard member's name fits a USTAR header's name field: so does a key of a tag of at most this
#: many UTF-8 bytes and a row below 10^9 (``TAG_ROW``, 9 digits)
MAX_TAG_BYTES = 100 - len(f"_{0:09d}.{TENSOR_EXT}")
