"""Tools over a finished dataset: :mod:`verify` (check it, optionally recompute samples),
:mod:`inspect` (show a sample with its loss mask), :mod:`read_samples` (given samples' tensors,
for evaluation), :mod:`synthetic` (write a random one)."""
