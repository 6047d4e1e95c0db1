"""The Transformers ``Trainer``: ``MasterWeightsTrainer`` (fp32 masters). See :mod:`.plugin`."""

from .plugin import MasterWeightsTrainer

__all__ = ["MasterWeightsTrainer"]
