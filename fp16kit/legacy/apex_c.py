"""apex's ``apex_C`` extension (``import apex_C``): ``flatten`` and ``unflatten``, torch's own.

apex's ``apex_C`` extension (``import apex_C``): ``flatten`` and ``unflatten``, the two ops
apex-era data-parallel code (NVIDIA BERT's ``run_pretraining.py``, apex's own ``Reducer``) called
to pack grads into one buffer for a single all-reduce. They are torch's own::

    flatten(tensors)          -> one 1-D tensor: the tensors' elements, in order
    unflatten(flat, tensors)  -> views of ``flat`` shaped like ``tensors``, in order

Under ``fp16kit run`` (or ``install_apex_alias()``) ``import apex_C`` gives this module.
"""

from __future__ import annotations

from torch._utils import _flatten_dense_tensors as flatten
from torch._utils import _unflatten_dense_tensors as unflatten

__all__ = ["flatten", "unflatten"]
