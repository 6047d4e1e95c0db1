"""apex.optimizers.fused_adam: ``FusedAdam``, a facade over :class:`fp16kit.optim.Adam` and ``LegacyAdam``.

apex.optimizers.fused_adam: ``FusedAdam``, a facade over :class:`fp16kit.optim.Adam`
(the rule since 2019-08) and :class:`fp16kit.optim.LegacyAdam` (the 2018-12 to 2019-08 rule).

* Built as apex's current class, it is Adam/AdamW with one step per param group and refuses
  the legacy ``step`` keywords with apex's RuntimeError.
* Built with ``eps_inside_sqrt=`` or ``max_grad_norm=`` (what BERT-era scripts pass, and
  apex's current class refuses with TypeError), or driven by the fused-era ``FP16_Optimizer``
  (through ``step_with_grads``, which calls ``step`` with the legacy keywords as apex's
  wrapper did), it follows the legacy rule: per-param ``step``, unscale and
  per-group clipping inside the update (docs/apex-others.md §1.4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...optim import Adam
from ...optim.legacy_adam import StepWithGrads, legacy_adam_step
from ..multi_tensor_apply import multi_tensor_adam
from ._unpickled import decays, settings_or_refusal

__all__ = ["FusedAdam"]

UPDATED = (
    "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, and call "
    "step() with no arguments."
)


class FusedAdam(StepWithGrads, Adam):
    """apex.optimizers.FusedAdam (see the module docstring).

    ``capturable`` is accepted and changes nothing (same numbers as unscale-then-step);
    ``master_weights`` needs it, as in apex, and is not provided: wrap the optimizer in
    ``fp16kit.MixedPrecisionOptimizer``."""

    display_name = "FusedAdam"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    dtype_error = "FusedAdam only support fp16 and fp32."
    #: apex's attribute: subclasses that rewrite step() (fairseq's FusedAdamV2) look for it
    #: and call it through multi_tensor_applier with ``_dummy_overflow_buf``
    multi_tensor_adam = staticmethod(multi_tensor_adam)

    @property
    def _dummy_overflow_buf(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        eps_inside_sqrt: bool | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        if master_weights:
            raise RuntimeError(
                "fp16kit's FusedAdam keeps no master weights of its own: build it on the model's "
                "params and wrap it, fp16kit.MixedPrecisionOptimizer(FusedAdam(...)), for fp32 masters."
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            set_grad_none=set_grad_none,
        )
        self.capturable = capturable
        self.master_weights = master_weights
        self.legacy_rule = eps_inside_sqrt is not None or max_grad_norm is not None
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        if self.legacy_rule:  # the legacy class kept the clip norm in each group
            self.defaults["max_grad_norm"] = 0.0 if max_grad_norm is None else max_grad_norm
            for group in self.param_groups:
                group.setdefault("max_grad_norm", self.defaults["max_grad_norm"])

    def _settings_for_bare_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in state["defaults"]:  # the 2018-12..2019-08 class: eps_mode on the object
            lost = ["eps_inside_sqrt"]
        else:
            lost = ["adam_w_mode"] if decays(state) else []
            if isinstance(state["defaults"].get("lr"), torch.Tensor):  # capturable: masters on the object
                lost.append("master_weights")
        return settings_or_refusal(FusedAdam, state, lost)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float | torch.Tensor | None = None,
        grad_norms: Sequence[Any] | None = None,
        grad_scaler: Any = None,
    ) -> Any:
        legacy_keywords = any(v is not None for v in (grads, output_params, scale, grad_norms))
        if legacy_keywords and not (self.legacy_rule or self._driven_by_wrapper):
            raise RuntimeError(UPDATED)
        if grad_scaler is not None and self.capturable:
            raise RuntimeError(
                "fp16kit's FusedAdam does not read a GradScaler inside step(): call "
                "scaler.step(optimizer) (it unscales the grads and skips overflowing steps)."
            )
        if not (self.legacy_rule or legacy_keywords):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        legacy_adam_step(
            self,
            grads,
            output_params,
            1.0 if scale is None else scale,
            grad_norms,
            eps_inside_sqrt=self.eps_inside_sqrt,
        )
        return loss
