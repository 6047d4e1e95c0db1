"""What every optimizer of :mod:`fp16kit.optim` shares.

Buckets of params, fp32 working copies, state kept in the working dtype, apex's ``zero_grad`` and error texts.

Arithmetic contract (apex's fused kernels: fp32 math on fp16/bf16 data)::

    work dtype = float32 for fp16/bf16/fp32 params, float64 for float64 params
    per bucket of params with a grad, grouped by (device, dtype):
        p32, g32 = the params and grads in the work dtype (copies for low precision;
                   fp32 params are updated in place, their grads never written)
        state tensors live in the work dtype
        ... the optimizer's rule, with torch._foreach_* ops over the bucket ...
        low-precision params: p = round_to_param_dtype(p32)      # one rounding per step

Nothing here reads a tensor's value on the host.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..core import kernels

__all__ = [
    "ApexConventions",
    "Bucket",
    "FusedStyleOptimizer",
    "buckets",
    "check_hyper",
    "check_state_shapes",
    "keep_state_precision",
    "public_settings",
    "with_settings",
    "work_dtype",
]

_TORCH_STATE = ("defaults", "state", "param_groups")  # what torch's Optimizer.__getstate__ keeps
SPARSE_ERROR = "{name} does not support sparse gradients, please consider SparseAdam instead"


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: float32 for fp16/bf16/fp32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Bucket:
    """Params of one (device, dtype) with their grads, and fp32 working copies of both."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.params = params
        self.grads = grads
        self.dtype = work_dtype(params[0].dtype)
        self.low_precision = params[0].dtype != self.dtype
        self.p32 = [p.detach().to(self.dtype) for p in params] if self.low_precision else [p.detach() for p in params]
        # Grads are never written: an fp32 grad is used as it is, others converted (a copy).
        self.g32 = [g.to(self.dtype) for g in grads]

    def write_back(self, outputs: Sequence[torch.Tensor] | None = None) -> None:
        """Round the working copies into the params (low precision), and into ``outputs`` when given.

        ``outputs``: apex's ``output_params``, any dtype, one rounding."""
        if self.low_precision:
            kernels.copy_to_(self.p32, [p.detach() for p in self.params])
        if outputs is not None:
            pairs = [(s, o) for s, o in zip(self.p32, outputs) if o is not None and o is not s]
            kernels.copy_pairs_(pairs)


def buckets(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    extra: Sequence[Sequence[Any]] = (),
) -> list[tuple[Bucket, list[list[Any]]]]:
    """Group ``params`` and their ``grads`` (and parallel lists ``extra``) by the params' (device, dtype).

    Keeps their order: one :class:`Bucket` per group."""
    index: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        index.setdefault((p.device, p.dtype), []).append(i)
    out = []
    for idx in index.values():
        bucket = Bucket([params[i] for i in idx], [grads[i] for i in idx])
        out.append((bucket, [[col[i] for i in idx] for col in extra]))
    return out


class ApexConventions:
    """apex's conventions shared by every optimizer of :mod:`fp16kit.optim`.

    A mixin before a ``torch.optim.Optimizer`` base: :class:`FusedStyleOptimizer`,
    :class:`~fp16kit.optim.SGD`.

    * ``display_name`` appears in the error texts (apex's "Fused<Name> does not support ...");
      ``sparse_error`` is the text for a sparse grad (``{name}``: the display name).
    * ``zero_grad(set_to_none=None)``: None follows the ``set_grad_none`` given at construction
      (apex's ``zero_grad()`` took no argument); False zeroes grads in place.
    * ``load_state_dict`` checks the state's shapes first and keeps it in the work dtype;
      pickling / deepcopy keep the optimizer-wide settings (:func:`with_settings`).
    """

    display_name = "Optimizer"
    sparse_error = SPARSE_ERROR
    set_grad_none: bool
    param_groups: list[dict[str, Any]]
    state: Any

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if set_to_none is None:
            set_to_none = self.set_grad_none
        params = [p for group in self.param_groups for p in group["params"]]
        kernels.clear_grads_(params, set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_shapes(self, state_dict)  # type: ignore[arg-type]
        super().load_state_dict(state_dict)  # type: ignore[misc]
        keep_state_precision(self, state_dict)  # type: ignore[arg-type]

    def __getstate__(self) -> dict[str, Any]:
        return with_settings(self, super().__getstate__())  # type: ignore[arg-type, misc]

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling (not load_state_dict, which passes a built optimizer its groups): a pickle
        # without the settings with_settings keeps holds torch's three keys only -- apex's fused
        # optimizers saved whole (torch.save(optimizer)) under fp16kit's apex alias
        if "defaults" not in self.__dict__ and "set_grad_none" not in state:
            state = {**state, **self._settings_for_bare_pickle(state)}
        super().__setstate__(state)  # type: ignore[misc]

    def _settings_for_bare_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        """The settings (attributes) an optimizer unpickled from torch's ``defaults`` / ``state`` /
        ``param_groups`` alone gets, or ``pickle.UnpicklingError`` where they cannot be known. The
        apex facades give apex's defaults where no other value would change the updates."""
        name = type(self).__name__
        raise pickle.UnpicklingError(
            f"This {name} pickle holds only torch's defaults, state and param_groups, not the settings "
            f"{name} keeps on the object (set_grad_none and its update rule's): rebuild the optimizer "
            "and pass the saved optimizer.state_dict() to its load_state_dict."
        )

    def check_dtype(self, p: torch.Tensor) -> None:
        """Refuse a param the step cannot update (nothing here; see FusedStyleOptimizer)."""

    def with_grads(
        self,
        group: dict[str, Any],
        grads: Sequence[torch.Tensor | None] | None = None,
        outputs: Sequence[Any] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """Return the group's params that have a grad, those grads (detached) and their outputs.

        A param's grad is ``grads[i]`` when given and not None, else ``p.grad``; its output ``outputs[i]``
        (None when not given). Supplied lists are zipped with the params, as apex did: the shortest one
        decides, and params past its end are not stepped. Sparse grads raise ``sparse_error``; params of an
        unsupported dtype apex's error (:meth:`check_dtype`)."""
        n = len(group["params"])
        for supplied in (grads, outputs):
            if supplied is not None:
                n = min(n, len(supplied))
        params, found, outs = [], [], []
        for i, p in enumerate(group["params"][:n]):
            g = p.grad if grads is None or grads[i] is None else grads[i]
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(self.sparse_error.format(name=self.display_name))
            self.check_dtype(p)
            params.append(p)
            found.append(g.detach())
            outs.append(None if outputs is None else outputs[i])
        return params, found, outs

    def params_with_grads(
        self, group: dict[str, Any], grads: Sequence[torch.Tensor | None] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`with_grads` without the outputs."""
        params, found, _ = self.with_grads(group, grads)
        return params, found

    def check_state(self, params: Iterable[torch.Tensor], keys: Sequence[str]) -> None:
        """Check, before a step changes anything, that each state tensor ``keys`` of ``params`` has its param's shape.

        ``params``: those of every group. Else the RuntimeError :meth:`work_state` raises."""
        for p in params:
            state = self.state.get(p)
            if not state:
                continue
            for key in keys:
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.shape != p.shape:
                    raise RuntimeError(_shape_error(self.display_name, key, t, p))


def _shape_error(name: str, key: str, t: torch.Tensor, p: torch.Tensor) -> str:
    return (
        f"{name}: state[{key!r}] has shape {tuple(t.shape)} but its param has "
        f"{tuple(p.shape)}; the loaded optimizer state belongs to other params (load the "
        "state dict saved with these params)."
    )


class FusedStyleOptimizer(ApexConventions, torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` with apex's conventions for its fused optimizers (:class:`ApexConventions`).

    ``supported_dtypes`` (None: any floating dtype) is checked at each step."""

    supported_dtypes: tuple[torch.dtype, ...] | None = None
    dtype_error = ""

    def __init__(self, params: Any, defaults: dict[str, Any], *, set_grad_none: bool = True) -> None:
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def check_dtype(self, p: torch.Tensor) -> None:
        if not p.is_floating_point():
            raise RuntimeError(f"{self.display_name} steps floating-point params, got {p.dtype}.")
        if self.supported_dtypes is not None and p.dtype not in self.supported_dtypes:
            raise RuntimeError(self.dtype_error or f"{self.display_name} only support fp16 and fp32.")

    def work_state(self, p: torch.Tensor, key: str, *, init: str = "zeros") -> torch.Tensor:
        """Return ``state[p][key]`` in the work dtype, created as zeros on first use.

        A state loaded in another dtype (torch's load_state_dict casts to the param's) is converted once."""
        state = self.state[p]
        dtype = work_dtype(p.dtype)
        t = state.get(key)
        if t is None:
            t = state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif t.dtype != dtype or t.device != p.device:
            t = state[key] = t.to(device=p.device, dtype=dtype)
        if t.shape != p.shape:
            raise RuntimeError(_shape_error(self.display_name, key, t, p))
        return t

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict installs the *saved* groups through __setstate__: a setting a
        # checkpoint lacks (one from torch's AdamW has no 'bias_correction') keeps the
        # constructor's value, as torch's own optimizers do, instead of a KeyError at the step
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def advance_group_step(self, group: dict[str, Any]) -> int:
        """Advance apex's group step: one count per param group, at every ``step()``.

        Also for params without a grad, and groups without any. A group without a count whose params carry
        torch's per-param ``state[p]['step']`` (a torch Adam(W) checkpoint) continues from the most steps any
        of them took; those per-param counts are dropped."""
        if "step" not in group:
            group["step"] = self._adopt_param_steps(group)
        group["step"] = int(group["step"]) + 1
        return group["step"]

    def _adopt_param_steps(self, group: dict[str, Any]) -> int:
        # once, at the first step after such a load: one host read per param with a count
        steps = [self.state[p].pop("step") for p in group["params"] if "step" in self.state.get(p, {})]
        return max((int(s) for s in steps), default=0)


def check_hyper(lr: float, betas: tuple[float, float] | None, eps: float, weight_decay: float) -> None:
    """Check the hyper-parameters with torch's checks and texts, before anything is built.

    ``betas`` None: an optimizer without them, Adagrad."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None and not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if betas is not None and not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_state_shapes(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Check, before loading, that every saved per-param state tensor has its param's shape.

    Except a 0-dim ``step``. Else ``ValueError`` naming the group, the param and the key (torch's
    ``load_state_dict`` checks only the group sizes)."""
    for gi, (saved, group) in enumerate(zip(state_dict.get("param_groups", []), opt.param_groups)):
        for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
            for key, value in state_dict.get("state", {}).get(pid, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"Optimizer state of group {gi}, param {pi}: {key!r} has shape "
                        f"{tuple(value.shape)}, the param {tuple(p.shape)}. Load the state dict "
                        "saved with these params."
                    )


def keep_state_precision(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Put back the saved state values in the work dtype after ``torch.optim.Optimizer.load_state_dict``.

    torch's load casts floating-point state to each param's dtype (fp16 moments for fp16 params); this puts
    back the saved values, so that a save/load round trip is exact."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for pid, p in zip(saved_ids, params):
        for key, value in state_dict["state"].get(pid, {}).items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                opt.state[p][key] = value.to(device=p.device, dtype=work_dtype(p.dtype), copy=True)


def public_settings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Return the optimizer-wide settings kept as public attributes (``adam_w_mode``, ``set_grad_none``, ...).

    Not torch's ``defaults`` / ``state`` / ``param_groups``, nor functions others patch onto the instance (an
    LR scheduler's ``step`` wrapper is bound to *this* optimizer)."""
    return {k: v for k, v in vars(opt).items() if not k.startswith("_") and k not in _TORCH_STATE and not callable(v)}


def with_settings(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """Add the :func:`public_settings` to torch's ``Optimizer.__getstate__``.

    torch keeps only defaults, state and param groups; with the settings, pickling and ``copy.deepcopy`` keep
    them (a copy that kept a scheduler's ``step`` wrapper would step the original)."""
    return {**public_settings(opt), **state}
