"""fp32 master weights for fp16/bf16 models: :class:`MixedPrecisionOptimizer` and its parts.

- :mod:`.optimizer` -- the optimizer users hold (torch.optim's API, the master-weight protocol);
- :mod:`.wrapping` -- what it shares with every optimizer that wraps another (``step`` as a commit);
- :mod:`.groups`, :mod:`.grads` -- masters per param group; model grads -> master grads;
- :mod:`.step_state`, :mod:`.snapshot` -- one step's stage, and what a queued step reads;
- :mod:`.async_step` -- steps on the optimizer thread (docs/async.md);
- :mod:`.checkpoint` -- matching a state dict's masters to the params; :mod:`.misuse` -- the
  errors for torch.amp call orders that cannot work with masters.
"""

from .optimizer import MixedPrecisionOptimizer

__all__ = ["MixedPrecisionOptimizer"]
