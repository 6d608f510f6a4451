"""Known-harmless Lightning output, silenced narrowly (by message and module), once per process.

* Lightning's ``lightning`` logger has its own stderr handler *and* propagates to the root
  logger the ``eagle-data`` CLI configures: every line came twice ("INFO: Seed set to 0" and
  "INFO lightning.fabric.utilities.seed: Seed set to 0"). It stops propagating.
* Its "try litlogger" tip is dropped, and so is jsonargparse's note that it cannot echo
  callbacks that arrive already built; the warnings below are about Lightning's own
  internals or this project's deliberate choices (an ``IterableDataset`` with ``__len__``: the
  loader's length is exact per rank and worker count; no TensorBoard installed; a deprecated
  ``LeafSpec`` check inside Lightning).
"""

from __future__ import annotations

import logging
import warnings

#: (message regex, module regex) of warnings that are Lightning internals or deliberate here
WARNINGS = (
    (r"Starting from v1\.9\.0, `tensorboardX` has been removed", r"lightning\."),
    (r"Your `IterableDataset` has `__len__` defined", r"lightning\."),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\."),
    (r"Total length of `.*` across ranks is zero", r"lightning\."),
    (r"The number of training batches \(\d+\) is smaller than the logging interval", r"lightning\."),
    # `eagle-data train --trainer.callbacks '[{"class_path": ...}]'`: the callbacks arrive built, and
    # LightningCLI's config echo cannot re-serialise them (the run is unaffected)
    (r"\s*Unable to serialize instance <", r"jsonargparse"),
)
_done = False


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_lightning() -> None:
    """Apply the filters above (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    import lightning  # noqa: F401 - installs its handler on the "lightning" logger

    root = logging.getLogger("lightning")
    root.propagate = False
    for h in root.handlers:
        h.addFilter(_DropTips())
    for msg, mod in WARNINGS:
        warnings.filterwarnings("ignore", message=msg, module=mod)
