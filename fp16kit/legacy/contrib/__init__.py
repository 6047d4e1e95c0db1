"""apex.contrib -> fp16kit.legacy.contrib: the parts of apex.contrib that BERT-era fp16 scripts import.

``apex.contrib.optimizers``."""

from . import optimizers

__all__ = ["optimizers"]
