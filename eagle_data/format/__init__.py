"""The on-disk contract, both ways: file names (:mod:`layout`), tensors and index columns
(:mod:`schema`), JSON records (:mod:`records`), the safetensors payload (:mod:`payload`) and
the tar framing (:mod:`tar`). Nothing else knows how a dataset directory is laid out."""
