"""apex O1's op lists (apex/amp/lists/), as names: what ran in fp16, in fp32, promoted, banned.

apex patched these names in ``torch.nn.functional``, ``torch`` and ``torch.Tensor``. Here every
name is looked up in all three namespaces (:func:`resolve`): ``Tensor.softmax`` and
``torch.softmax`` run in fp32 like ``F.softmax`` (CUDA autocast runs all three in fp32 too;
apex patched only ``F.softmax``), ``torch.lstm`` is the function ``nn.LSTM`` calls. Names torch
does not have (``conv_tbc`` on a build without it, ``__div__``) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BANNED", "FP16", "FP32", "FP32_INPLACE", "PROMOTE", "resolve"]

FP16 = (
    # functional_overrides.FP16_FUNCS
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "linear",
    # torch_overrides.FP16_FUNCS (bmm: CUDA >= 9.1, i.e. always) and Tensor.__matmul__
    "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm",
    "__matmul__", "__rmatmul__",
    # the RNN backend apex re-routed through fp16 (rnn_compat), and the cells
    "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
)

FP32 = (
    # functional_overrides.FP32_FUNCS
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div",
    "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits",
    "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss", "ctc_loss",
    # torch_overrides.FP32_FUNCS (mean only on torch < 1.1)
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
    # tensor_overrides.FP32_FUNCS: a half tensor moved to the CPU comes back fp32
    "__pow__", "__rpow__", "__ipow__", "cpu",
)

FP32_INPLACE = tuple(name + "_" for name in FP32 if not name.startswith("__"))
"""``exp_``, ``log_``, ``pow_``, ...: apex raised NotImplementedError for fp16 arguments."""

PROMOTE = (
    # torch_overrides.CASTS
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul",
    "eq", "equal", "ge", "gt", "le", "lt", "ne",
    # tensor_overrides.CASTS, as torch hands the operators over: `a - b` is Tensor.sub,
    # `a == b` Tensor.__eq__, `1 - a` Tensor.__rsub__ (in-place ones are add_ ...: not promoted)
    "sub", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__rsub__", "__rdiv__", "__rtruediv__",
)

BANNED = {
    "binary_cross_entropy": (
        "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` "
        "It requires that the output of the previous function be already a FloatTensor. \n\n"
        "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
        "    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single layer "
        "that is compatible with amp.\nAnother option is to add\n"
        "    amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.init()`.\n"
        "If you _really_ know what you are doing, you can disable this warning by passing "
        "allow_banned=True to `amp.init()`."
    ),
}
"""name -> apex's NotImplementedError text (raised when an argument is fp16)."""

_NAMESPACES: tuple[Any, ...] = (F, torch, torch.Tensor)


def resolve(names: Iterable[str]) -> dict[Callable[..., Any], str]:
    """``{function object: name}`` for every name in every namespace that has it (the objects
    ``__torch_function__`` is handed: ``torch.Tensor.sum`` for ``x.sum()``, ``F.softmax``, ...)."""
    found: dict[Callable[..., Any], str] = {}
    for name in names:
        for namespace in _NAMESPACES:
            fn = getattr(namespace, name, None)
            if callable(fn):
                found.setdefault(fn, name)
    return found
