"""apex.amp.lists: the op lists of amp O1, as plain mutable lists of names, in apex's layout.

::

    functional_overrides   MODULE = torch.nn.functional   FP16_FUNCS, FP32_FUNCS, BANNED_FUNCS
    torch_overrides        MODULE = torch                 FP16_FUNCS, FP32_FUNCS, CASTS, SEQUENCE_CASTS
    tensor_overrides       MODULE = torch.Tensor          FP16_FUNCS, FP32_FUNCS, CASTS, SEQUENCE_CASTS

Every O1 ``amp.initialize`` (and ``amp.init()``) reads them as they stand then, so edits made
before it take effect, as in apex (NVIDIA's Tacotron2 and WaveGlow move ``'softmax'`` from
``functional_overrides.FP32_FUNCS`` to ``FP16_FUNCS``); edits made after it wait for the next one.
What a list entry does (:mod:`fp16kit.legacy.amp.o1_lists`), and how entries become functions:

- an entry covers ``MODULE.<name>`` (apex's patch); a Tensor operator entry covers the method
  torch hands the operator to (``__add__`` and ``__radd__``: ``Tensor.add``; ``__pow__``:
  ``Tensor.pow``). Names the module does not have are skipped, as apex skipped them.
- one function object under several entries follows the first in apex's order: the FP16 list,
  then the FP32 list of ``functional_overrides``, of ``torch_overrides``, of ``tensor_overrides``,
  then ``CASTS`` and ``SEQUENCE_CASTS``; ``BANNED_FUNCS`` is checked before any of them.
- an entry of an FP16, FP32 or CASTS list also covers the same name in the other two namespaces
  where apex's shipped lists of that namespace do not name it (``torch.softmax`` and
  ``x.softmax()`` follow ``functional_overrides``' ``'softmax'``; ``torch.sub`` follows
  ``__sub__``). ``BANNED_FUNCS`` covers ``F.<name>`` only.
- a name removed from a module's lists stops covering that module's function, even where
  another module still lists it: removing ``'exp'`` from ``torch_overrides.FP32_FUNCS`` changes
  ``torch.exp`` only (``tensor_overrides`` copied ``'exp'`` at import: ``x.exp()`` stays fp32),
  as in apex. A function no entry covers follows the device's autocast.
- ``F.conv1d`` is ``torch.conv1d`` (one function): it keeps its rule while either list names it.
- the in-place forms of the FP32 names (``torch.exp_``, ``x.exp_()``) refuse fp16 arguments.
- ``amp.register_half_function`` / ``register_float_function`` / ``register_promote_function``
  decide for the function registered, whatever the lists say (apex's innermost wrapper).
"""

from . import functional_overrides, tensor_overrides, torch_overrides

__all__ = ["functional_overrides", "torch_overrides", "tensor_overrides"]

# The lists as shipped, taken before a script can edit them (this package is imported before
# any of its modules is handed out): a namespace's shipped names decide where an entry of
# another namespace's lists reaches (see above).
_SHIPPED: dict[str, tuple[str, ...]] = {
    module.__name__.rpartition(".")[2]: tuple(
        entry[0] if isinstance(entry, tuple) else entry
        for list_name in ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS", "BANNED_FUNCS")
        for entry in getattr(module, list_name, ())
    )
    for module in (functional_overrides, torch_overrides, tensor_overrides)
}
