"""apex-era checkpoints: read safely (:func:`load_checkpoint`), and converted to plain data.

- :mod:`.scan` -- bound a file's cost before anything is inflated or unpickled (zip directory,
  pickle opcodes, storages);
- :mod:`.unpickler` -- the restricted unpickler: apex classes to plain records, every other
  global refused; :mod:`.records` -- those records;
- :mod:`.load` -- ``load_checkpoint``; :mod:`.errors` -- refusals that name the file and the fix;
- :mod:`.convert` -- ``fp16kit convert-checkpoint``: a file torch's ``weights_only`` loader reads.
"""

from .load import load_checkpoint

__all__ = ["load_checkpoint"]
