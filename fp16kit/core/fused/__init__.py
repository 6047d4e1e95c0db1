"""Fused kernels: one pass per step where the machine allows, torch's ops the reference and the fallback.

* :mod:`~fp16kit.core.fused.adam` -- the master Adam/AdamW step on the CPU, from the 16-bit grad to the
  16-bit param in one pass, bit for bit torch's fused Adam/AdamW on the fp32 masters plus the copy back.
* :mod:`~fp16kit.core.fused.unscale` -- the master-grad path (16-bit grads -> unscaled fp32 master grads and
  the non-finite flag) in one pass.
* :mod:`~fp16kit.core.fused.calibrate` -- finds how torch's fused Adam rounds on this machine (the kernel's
  forms), or keeps the kernel off.
* :mod:`~fp16kit.core.fused.abi` -- the C kernels' interface: the library, its signatures, the values passed.
* :mod:`~fp16kit.core.fused.build` -- builds a kernel's C source at first use (cached per machine) and
  loads it; ``FP16KIT_FUSED=0`` turns every kernel off.

Nothing here is required: when a kernel is off (no compiler, another CPU, ``FP16KIT_FUSED=0``, a form
of torch's rounding it cannot reproduce) the callers run torch's ops, with one log line saying why.
"""

from .adam import AdamPlan, GradAddresses, PlanMismatch, check_finite_, kernel_refusal, unscaled_grads
from .calibrate import forms

__all__ = ["AdamPlan", "GradAddresses", "PlanMismatch", "check_finite_", "forms", "kernel_refusal", "unscaled_grads"]
