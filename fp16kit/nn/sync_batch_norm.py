"""Batch norm whose statistics span a process group, on any device and backend (gloo included).

Training step (per channel c; "over all ranks" = one differentiable all-reduce):

    n_r, mean_r, var_r = this rank's count, mean, biased variance      (fp32, two-pass)
    [N, S, Q] = all_reduce_sum([n_r, n_r * mean_r, n_r * (var_r + mean_r**2)])   (fp64 on CPU/CUDA)
    mean = S / N ;  var = Q / N - mean**2                              (biased, over all ranks)
    out  = (x - mean) * rsqrt(var + eps) * weight + bias               (fp32, then x's dtype)
    if channel-last path: out = out + z (if given); out = relu(out) (if fuse_relu)
    running_mean = (1 - m) * running_mean + m * mean
    running_var  = (1 - m) * running_var  + m * var * N / (N - 1)      (unbiased, all ranks)
    m = momentum, or 1 / num_batches_tracked when momentum is None (cumulative average)

Ranks may hold different batch sizes (even zero): the counts weight every rank's share, so the
result is batch norm over the concatenated batch. The all-reduce is differentiable: its
backward all-reduces the gradients, so input grads are those of that concatenated batch norm.
Sums are formed from each rank's centred statistics and combined in float64 (float32 where the
device has no float64), so a large mean does not cancel the variance away.

Layouts: channel-first ``(N, C, ...)`` or, with ``channel_last=True``, ``(N, ..., C)``; a 2-D
input ``(N, C)`` takes the channel-last path (apex's rule). Only that path honours ``z`` and
``fuse_relu``, as in apex. Eval with running stats: ``F.batch_norm`` (channel-last inputs are
viewed channel-first for it), then ``z``/ReLU on the channel-last path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ..core.log import log_once

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _stats_dtype(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def _as(value: float | torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    return value.to(dtype) if isinstance(value, torch.Tensor) else value


class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over the group: forward all-reduces a copy, backward all-reduces the
    grad (every rank's loss depends on every rank's statistics). torch.distributed.nn's
    all_reduce did this, but torch >= 2.13 deprecates it (a FutureWarning at every run)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllReduceSum.apply(grad, ctx.group), None


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the batches of every rank in ``process_group`` (module docstring).

    Same parameters and buffers as ``nn.BatchNorm*d`` (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``). Without an initialised process group, or with a
    group of one rank, it is batch norm over the local batch. ``forward(input, z=None)``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(process_group).__name__}; create one with torch.distributed.new_group(ranks)."
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def __setstate__(self, state: dict[str, Any]) -> None:
        # apex's SyncBatchNorm pickled whole (torch.save(model)) and loaded under fp16kit's apex
        # alias lacks what its apex version did not keep: the Python fallback never had
        # channel_last (it refused True) nor a fused ReLU; the CUDA class kept channel_last from
        # 2019-01 and fuse_relu from 2019-04; neither kept a process group before 2018-12.
        # Their absence meant exactly these values.
        super().__setstate__(state)
        for name, default in (("process_group", None), ("channel_last", False), ("fuse_relu", False)):
            self.__dict__.setdefault(name, default)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        channels = input.size(-1) if self.channel_last or input.dim() == 2 else input.size(1)
        if channels != self.num_features:
            where = "last" if self.channel_last or input.dim() == 2 else "second (dim 1)"
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got {channels} channels in the {where} dimension of an "
                f"input of size {tuple(input.shape)}; "
                + (
                    "pass channel_last=False for (N, C, ...) inputs."
                    if self.channel_last
                    else "pass channel_last=True for (N, ..., C) inputs."
                )
            )

    def _group(self) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        self._check_input_dim(input)
        last = self.channel_last or input.dim() == 2
        if not last and (z is not None or self.fuse_relu):
            log_once(
                ("SyncBatchNorm", "z"),
                "SyncBatchNorm: z and fuse_relu apply only on the channel-last path "
                "(channel_last=True or 2-D input), as in apex; ignored for this channel-first input",
            )
        use_batch_stats = self.training or not self.track_running_stats
        if use_batch_stats:
            out = self._train_forward(input, last)
        else:
            out = self._eval_forward(input, last)
        if last:
            if z is not None:
                compute = torch.promote_types(input.dtype, torch.float32)
                out = (out.to(compute) + z.to(compute)).to(input.dtype)
            if self.fuse_relu:
                out = torch.relu(out)
        return out

    def _eval_forward(self, input: torch.Tensor, last: bool) -> torch.Tensor:
        x = input.movedim(-1, 1) if last and input.dim() > 2 else input
        tensors = [self.running_mean, self.running_var, self.weight, self.bias]
        if any(t is not None and t.dtype != input.dtype for t in tensors):
            # F.batch_norm refuses some dtype mixes; compute in fp32 as apex's kernel did
            x = x.float()
            tensors = [None if t is None else t.float() for t in tensors]
        running_mean, running_var, weight, bias = tensors
        out = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, self.eps)
        out = out.movedim(1, -1) if last and input.dim() > 2 else out
        return out.to(input.dtype)

    def _train_forward(self, input: torch.Tensor, last: bool) -> torch.Tensor:
        channel_dim = input.dim() - 1 if last else 1
        dims = [d for d in range(input.dim()) if d != channel_dim]
        count = input.numel() // max(input.size(channel_dim), 1)
        group = self._group()
        if group is None and count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")
        compute = torch.promote_types(input.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
        x = input.to(compute)
        acc = _stats_dtype(input.device)
        if count:
            var_r, mean_r = torch.var_mean(x, dim=dims, correction=0)
            n_r = torch.full_like(mean_r, count, dtype=acc)
            mean_r, var_r = mean_r.to(acc), var_r.to(acc)
            stats = torch.stack([n_r, n_r * mean_r, n_r * (var_r + mean_r * mean_r)])
        else:  # an empty batch on this rank still joins the collective
            stats = x.new_zeros((3, self.num_features), dtype=acc) + x.sum(dims).to(acc) * 0
        if group is not None:
            stats = _AllReduceSum.apply(stats, group)
        n, s, q = stats.unbind(0)
        mean = s / n
        var = (q / n - mean * mean).clamp_min(0)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        shape = [1] * input.dim()
        shape[channel_dim] = self.num_features
        invstd = torch.rsqrt(var.to(compute) + self.eps)
        out = (x - mean.to(compute).view(shape)) * invstd.view(shape)
        if self.weight is not None:
            out = out * self.weight.to(compute).view(shape)
        if self.bias is not None:
            out = out + self.bias.to(compute).view(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        tracked, running_mean, running_var = self.num_batches_tracked, self.running_mean, self.running_var
        # the caller checked track_running_stats: the buffers exist
        assert tracked is not None and running_mean is not None and running_var is not None
        tracked += 1  # in place, as ``self.num_batches_tracked += 1`` on the buffer
        m: float | torch.Tensor
        if self.momentum is None:  # 1 / n in double on the device: no host read of the count
            m = 1.0 / tracked.to(_stats_dtype(tracked.device))
        else:
            m = self.momentum
        unbiased = var * n / (n - 1)
        for buf, new in ((running_mean, mean), (running_var, unbiased)):
            # each product rounded to the buffer's dtype, with m and 1 - m in the op-math dtype
            # (what multiplying by a Python float does, so a tensor m gives the same bits)
            op = torch.promote_types(buf.dtype, torch.float32)
            keep = _as(1 - m, op)
            old = (buf.to(op) * keep).to(buf.dtype)
            added = (_as(m, op) * new.to(buf.dtype).to(op)).to(buf.dtype)
            buf.copy_(old + added)


def convert_sync_batchnorm(
    module: nn.Module, process_group: dist.ProcessGroup | None = None, channel_last: bool = False
) -> nn.Module:
    """Replace every ``_BatchNorm`` in ``module`` by a :class:`SyncBatchNorm`, torch's way.

    As ``nn.SyncBatchNorm.convert_sync_batchnorm``: the new module reuses the old one's Parameters (an
    optimizer built before conversion still updates them) and buffers, and copies its ``training`` flag.
    InstanceNorm is never converted. Returns the converted module (``module`` itself is changed in place where
    it is not a batch norm)."""
    if isinstance(module, _InstanceNorm) or not isinstance(module, _BatchNorm):
        converted = module
    else:
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group, channel_last))
    return converted
