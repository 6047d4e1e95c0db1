"""apex.parallel.distributed: ``DistributedDataParallel`` and ``Reducer`` on torch.distributed.

``DistributedDataParallel`` is torch's DDP (``isinstance`` passes; state-dict keys gain the
``module.`` prefix as under apex) built the way apex behaved (docs/apex-others.md §4.1):

    broadcast_buffers=False          apex broadcast parameters only, once, never buffers
    device_ids=[current device] on CUDA, None on CPU (gloo works)
    apex's gradient arithmetic       fp16kit.distributed.apex_allreduce_hook (sum, then
                                     x predivide/world; fp32 reduction; sum-only)
    delay_allreduce=True             find_unused_parameters=True (logged once)
    retain_allreduce_buffers=True    gradient_as_bucket_view=True (logged once)
    message_size, num_allreduce_streams, allreduce_communicators, allreduce_trigger_params
                                     only tuned apex's overlap: ignored, logged once
    shared_param, bad combinations   apex's ValueErrors, before anything is built
    gradient_average_split_factor    apex's old name: used as gradient_predivide_factor (apex's
                                     rename warning, logged once)

``gradient_average``, ``gradient_predivide_factor`` and ``allreduce_always_fp32`` are properties
over the communication hook's state: assigning one later changes the next all-reduce.

``flat_dist_call(tensors, call, extra_args=None)`` (NVIDIA's BERT broadcast its parameters with
``flat_dist_call([p.data for p in model.parameters()], torch.distributed.broadcast, (0,))``),
``apply_flat_dist_call``, ``split_by_type``, ``split_half_float_double``: apex's module-level
helpers (``call`` on each type's flattened tensors; ``dist.all_reduce`` averages).

``disable_allreduce()`` / ``enable_allreduce()`` switch torch's ``require_backward_grad_sync``
(what ``no_sync()`` does): call them before the forward whose backward they govern.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...core.log import log_once
from ...distributed import (
    ApexAllreduceState,
    all_reduce_mean_coalesced,
    apex_allreduce_hook,
    broadcast_coalesced,
    call_coalesced,
)

__all__ = [
    "DistributedDataParallel",
    "Reducer",
    "apply_flat_dist_call",
    "flat_dist_call",
    "split_by_type",
    "split_half_float_double",
]


def _log_once(argument: str, message: str) -> None:
    log_once(
        ("apex.parallel.DistributedDataParallel", argument),
        "apex.parallel.DistributedDataParallel(%s): %s",
        argument,
        message,
    )


def _check_apex_arguments(
    delay_allreduce: bool, shared_param: Any, allreduce_trigger_params: Any, num_allreduce_streams: int
) -> None:
    """apex's own refusals, in apex's order and words."""
    if num_allreduce_streams > 1 and delay_allreduce:
        raise ValueError("self.allreduce_different_streams may only be used if delay_allreduce=False.")
    if shared_param is not None:
        raise ValueError(
            "shared_param is no longer supported as an option.  It was misleadingly named from the start.  It "
            "turns out overlapping communication with computation should work fine with shared parameters.  If "
            "you still wish to delay communication to the end of the backward pass, use delay_allreduce=True|False "
            "instead."
        )
    if allreduce_trigger_params is not None and delay_allreduce:
        raise ValueError("Setting allreduce_trigger_params is only valid if delay_allreduce=False.")


def _log_mapped_arguments(
    message_size: int,
    delay_allreduce: bool,
    allreduce_trigger_params: Any,
    retain_allreduce_buffers: bool,
    num_allreduce_streams: int,
    allreduce_communicators: Any,
) -> None:
    overlap_only = "it only tuned apex's communication overlap; torch's DDP buckets on its own (ignored)"
    if message_size != 10000000:
        _log_once("message_size", overlap_only + "; torch's knob is bucket_cap_mb")
    if num_allreduce_streams != 1:
        _log_once("num_allreduce_streams", overlap_only)
    if allreduce_communicators is not None:
        _log_once("allreduce_communicators", overlap_only)
    if allreduce_trigger_params is not None:
        _log_once("allreduce_trigger_params", overlap_only)
    if delay_allreduce:
        _log_once(
            "delay_allreduce",
            "mapped to torch DDP's find_unused_parameters=True (params without "
            "grads are tolerated, as apex's delayed mode did); communication overlaps",
        )
    if retain_allreduce_buffers:
        _log_once(
            "retain_allreduce_buffers",
            "mapped to torch DDP's gradient_as_bucket_view=True (grads are views into the all-reduce buckets)",
        )


def _device_ids(module: nn.Module) -> list[int] | None:
    param = next(module.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return [torch.cuda.current_device()]
    return None


# What torch.save(model) wrote for an apex DistributedDataParallel: apex's __getstate__ returned
# None with NCCL (its `return` sat inside the non-NCCL branch, which raised KeyError), so the pickle
# holds the class and nothing else -- under fp16kit's apex alias an object without even nn.Module's
# state, which every use reaches through __getattr__
_EMPTY_APEX_PICKLE = (
    "This apex.parallel.DistributedDataParallel was unpickled from a file apex wrote with torch.save(model), "
    "not torch.save(model.module.state_dict()): apex's DistributedDataParallel pickled none of its state "
    "(its __getstate__ returned nothing), so the file holds neither the wrapped model nor its weights, "
    "with apex installed or not. Resume from a file saved with torch.save(model.module.state_dict(), PATH): "
    "load it into the model, then wrap the model, DistributedDataParallel(model)."
)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex's signature on torch's DDP (module docstring). ``module`` is the wrapped model."""

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Any = None,
        prof: bool = False,
    ) -> None:
        _check_apex_arguments(delay_allreduce, shared_param, allreduce_trigger_params, num_allreduce_streams)
        if gradient_average_split_factor is not None:
            log_once(
                ("apex.parallel.DistributedDataParallel", "gradient_average_split_factor"),
                "Warning:  gradient_average_split_factor has been renamed to gradient_predivide_factor.  "
                "For now, gradient_average_split_factor will also work, but please update to "
                "gradient_predivide_factor instead.",
                level=logging.WARNING,
            )
            gradient_predivide_factor = gradient_average_split_factor
        hook_state = ApexAllreduceState(None, gradient_average, gradient_predivide_factor, allreduce_always_fp32)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "apex.parallel.DistributedDataParallel needs the default process group: call "
                "torch.distributed.init_process_group(backend, init_method='env://') first (launch with torchrun)."
            )
        _log_mapped_arguments(
            message_size,
            delay_allreduce,
            allreduce_trigger_params,
            retain_allreduce_buffers,
            num_allreduce_streams,
            allreduce_communicators,
        )
        with warnings.catch_warnings():
            # torch >= 2.13 deprecates broadcast_buffers, and says to keep broadcast_buffers=False for
            # rank-local buffers until init_sync_buffers exists: exactly apex's behaviour here.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            super().__init__(
                module,
                device_ids=_device_ids(module),
                broadcast_buffers=False,
                find_unused_parameters=delay_allreduce,
                gradient_as_bucket_view=retain_allreduce_buffers,
            )
        hook_state.process_group = self.process_group
        self.register_comm_hook(hook_state, apex_allreduce_hook)
        self._apex_hook_state = hook_state
        self.delay_allreduce = delay_allreduce
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.prof = prof

    def __getattr__(self, name: str) -> Any:
        if "_modules" not in self.__dict__:  # made by unpickling apex's pickle (see _EMPTY_APEX_PICKLE)
            raise AttributeError(_EMPTY_APEX_PICKLE)
        return super().__getattr__(name)

    @property
    def gradient_average(self) -> bool:
        """Multiply the summed grads by ``predivide / world`` (apex's averaging); assignable."""
        return self._apex_hook_state.gradient_average

    @gradient_average.setter
    def gradient_average(self, value: bool) -> None:
        self._apex_hook_state.gradient_average = value

    @property
    def gradient_predivide_factor(self) -> float:
        """Grads are multiplied by ``1 / factor`` before the sum (a number > 0); assignable."""
        return self._apex_hook_state.gradient_predivide_factor

    @gradient_predivide_factor.setter
    def gradient_predivide_factor(self, value: float) -> None:
        dataclasses.replace(self._apex_hook_state, gradient_predivide_factor=value)  # validates
        self._apex_hook_state.gradient_predivide_factor = value

    @property
    def allreduce_always_fp32(self) -> bool:
        """All-reduce fp16/bf16 buckets in fp32; assignable."""
        return self._apex_hook_state.allreduce_always_fp32

    @allreduce_always_fp32.setter
    def allreduce_always_fp32(self, value: bool) -> None:
        self._apex_hook_state.allreduce_always_fp32 = value

    def disable_allreduce(self) -> None:
        """Skip the all-reduce of the grads of the following forward/backward (torch's ``no_sync()``).

        Grads accumulate locally until :meth:`enable_allreduce`."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """All-reduce again from the next forward/backward on (accumulated grads included)."""
        self.require_backward_grad_sync = True


class Reducer:
    """apex's manual gradient averaging.

    ``Reducer(module)``: broadcasts the module's parameters from rank 0 now; ``reduce()`` averages
    every existing ``p.grad`` over the ranks. ``Reducer(tensors)`` (a tensor or nested lists/tuples
    /dicts of them): collects those tensors once; ``reduce()`` averages those very objects (grads
    replaced later are not seen, as in apex). Averaging = sum, then ÷ world size, per dtype.
    """

    def __init__(self, module_or_grads_list: nn.Module | Any) -> None:
        if isinstance(module_or_grads_list, nn.Module):
            self.module: nn.Module | None = module_or_grads_list
            self.grads: list[torch.Tensor] = []
            broadcast_coalesced([p.data for p in self.module.parameters()], src=0)
        else:
            self.module = None
            self.grads = []
            _extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """All-reduce the grads (of the module's params, or the tensors given) and divide them by the world size."""
        if self.module is not None:
            tensors = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            tensors = self.grads
        all_reduce_mean_coalesced(tensors)


def _extract_tensors(maybe_tensor: Any, tensor_list: list[torch.Tensor]) -> None:
    """apex's extract_tensors: tensors found by iterating, anything else (None grads) skipped;
    dicts give their values (apex recursed into the keys and failed)."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    if isinstance(maybe_tensor, (str, bytes)):
        return
    if isinstance(maybe_tensor, dict):
        maybe_tensor = maybe_tensor.values()
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        _extract_tensors(item, tensor_list)


def apply_flat_dist_call(bucket: list[torch.Tensor], call: Any, extra_args: Any = None) -> None:
    """apex's: ``call(flat, *extra_args)`` on the flattened ``bucket``, copied back.

    apex's: ``call(flat, *extra_args)`` on the flattened ``bucket`` (one type), ÷ world size
    when ``call is dist.all_reduce``, copied back."""
    call_coalesced(bucket, call, extra_args, one_bucket=True)


def split_by_type(tensors: Any) -> dict[str, list[torch.Tensor]]:
    """apex's: ``{tensor.type(): [tensors of that type]}`` in first-seen order."""
    buckets: dict[str, list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def split_half_float_double(tensors: Any) -> list[list[torch.Tensor]]:
    """apex's: the half, float and double tensors, as up to three lists in that order.

    apex matched CUDA type names only; CPU tensors count here too."""
    tensors = list(tensors)
    buckets = []
    for dtype in (torch.float16, torch.float32, torch.float64):
        bucket = [t for t in tensors if t.dtype == dtype]
        if bucket:
            buckets.append(bucket)
    return buckets


def flat_dist_call(tensors: Any, call: Any, extra_args: Any = None) -> None:
    """apex's: :func:`apply_flat_dist_call` on each :func:`split_by_type` bucket."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)
