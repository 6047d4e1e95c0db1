"""The training loops rows 3 and 4 time: a real forward and backward on a small MLP, one fixed batch.

Row 3, the scaler alone (an fp32 model: no masters)::

    opt.zero_grad(); loss = mse(model(x), y); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()

with ``fp16kit.GradScaler`` against ``torch.amp.GradScaler`` (the anchor), for SGD (momentum 0.9)
and AdamW(fused=True). Same arithmetic: the params agree bit for bit.

Row 4, asynchronous steps: a bf16 MLP, ``fp16kit.MixedPrecisionOptimizer(AdamW(fused=True))`` and
``fp16kit.GradScaler``, the same loop with ``async_step=False`` (the anchor: every intra-op thread
on each op) and ``async_step=True`` (the step of iteration k on the optimizer thread beside the
forward/backward of k+1; the threads split as benchmarks/async_overlap.py does: half for the main
thread, the rest for the optimizer thread). The default ``async_policy="auto"`` probes both modes
(thread and inline) before the timed rounds; the variant's name says which it kept. A block of iterations is timed from the first
iteration to ``opt.synchronize()`` (the last step landed), so the asynchronous side pays for
filling and draining its pipeline once per block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fp16kit

from .loops import INIT_SCALE, Loop
from .shapes import MLP
from .timing import Clock

__all__ = ["AsyncLoop", "ScalerLoop", "split_threads"]


def split_threads(threads: int) -> tuple[int, int]:
    """The intra-op threads of the main thread and of the optimizer thread with asynchronous steps."""
    main = max(1, threads // 2)
    return main, max(1, threads - main)


class _ModelLoop(Loop):
    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: Any
    x: torch.Tensor
    y: torch.Tensor

    def train_step(self) -> None:
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(self.x).float(), self.y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def iteration(self, clock: Any) -> None:
        with clock:
            self.train_step()

    def masters(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"]]


class ScalerLoop(_ModelLoop):
    """Row 3: an fp32 model with ``torch.amp.GradScaler`` (``fp16kit_scaler=False``) or ``fp16kit.GradScaler``."""

    def __init__(self, mlp: MLP, device: torch.device | str, *, optimizer: str, fp16kit_scaler: bool) -> None:
        self.device = torch.device(device)
        self.name = "fp16kit.GradScaler" if fp16kit_scaler else "torch.amp.GradScaler"
        self.model = mlp.build(torch.float32, self.device)
        params = list(self.model.parameters())
        if optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        else:
            self.opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        cls = fp16kit.GradScaler if fp16kit_scaler else torch.amp.GradScaler
        self.scaler = cls(self.device.type, init_scale=INIT_SCALE)
        self.x, self.y = mlp.batch_data(torch.float32, self.device)


class AsyncLoop(_ModelLoop):
    """Row 4: a bf16 MLP with fp32 masters, synchronous (the anchor) or ``async_step=True``."""

    def __init__(self, mlp: MLP, device: torch.device | str, *, async_step: bool, threads: int) -> None:
        self.device = torch.device(device)
        self.name = "async_step=True" if async_step else "async_step=False"
        self.async_step = async_step
        self.threads = threads
        self.model = mlp.build(torch.bfloat16, self.device)
        self.mpo = fp16kit.MixedPrecisionOptimizer(
            torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True), async_step=async_step
        )
        self.opt = self.mpo
        self.scaler = fp16kit.GradScaler(self.device.type, init_scale=INIT_SCALE)
        self.x, self.y = mlp.batch_data(torch.bfloat16, self.device)
        self._main_threads: int | None = None  # the main thread's count as the last async block left it
        if async_step:  # async_policy="auto" measures both modes first (tens of steps, once per training): not timed
            self.run(0, until_chosen=True)
            self.name = f"async_step=True ({self.mpo.async_policy})"

    def _set_threads(self) -> None:
        if self.device.type != "cpu":
            return
        if not self.async_step:
            torch.set_num_threads(self.threads)
            return
        main, worker = split_threads(self.threads)
        # A training sets the split once; the policy may change the main thread's count (inline steps borrow the
        # optimizer thread's): each block goes on from where the last one left it, not from the split again.
        torch.set_num_threads(self._main_threads or main)
        thread = fp16kit.optimizer_thread()
        thread.wait(thread.submit(torch.set_num_threads, worker))

    def run(self, n: int, *, until_chosen: bool = False) -> float:
        self._set_threads()
        try:
            clock = Clock(self.device, wall=True)
            with clock:
                for _ in range(n):
                    self.train_step()
                while until_chosen and self.mpo.async_policy == "probing":
                    self.train_step()
                self.mpo.synchronize()
            return clock.seconds()
        finally:
            if self.async_step:
                self._main_threads = torch.get_num_threads()
            torch.set_num_threads(self.threads)

    def finish(self) -> None:
        self.mpo.synchronize()
