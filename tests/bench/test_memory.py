"""fp16kit.bench.memory: the counting of held bytes and of the step's peak, on cases whose bytes are known.

Exact counts where the dtypes imply them (no tolerance on the parts): per param fp32 params and grads 4 + 4,
AdamW's two moments 8 (plus its 4-byte ``step`` per param tensor); 16-bit params and grads 2 + 2; masters and
their grads 4 + 4. The run's other bytes (a scaler's scalars, a kernel plan's address arrays) stay under 4 KiB.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fp16kit.bench import memory, run_bench
from fp16kit.bench.report import to_json, to_markdown
from fp16kit.core import fused
from fp16kit.core.master import _SPARE_MIN_NUMEL

TINY = memory.MemoryModel("tiny", layers=2, width=256, batch=4)  # weights of 65536 elements: spares kept
N = TINY.numel()
TENSORS = 2 * TINY.layers
STEP_BYTES = 4 * TENSORS  # AdamW's fp32 `step`, one per param tensor
SMALL = 4096  # bytes, at most: a scaler's scalars, a kernel plan's address arrays
kernel_on = pytest.mark.skipif(fused.forms() is None, reason="the fused kernel is off on this machine")


pytestmark = pytest.mark.usefixtures("amp_state_restored")  # (tests/conftest.py)


def _measure(make, dtype):
    x = torch.randn(TINY.batch, TINY.width, generator=torch.Generator().manual_seed(1)).to(dtype)
    return memory.measure(make, lambda: TINY.build(dtype, torch.device("cpu")), x, variant="v", shape="tiny")


def _spared() -> int:
    """Bytes of the spare fp32 master grads core.master keeps between steps: those of the large tensors."""
    return 4 * sum(
        p.numel() for p in TINY.build(torch.float32, torch.device("cpu")).parameters() if p.numel() >= _SPARE_MIN_NUMEL
    )


def test_fp32_adamw_holds_16_bytes_per_param_exactly():
    f = _measure(memory.TorchRecipe, torch.float32)
    assert f.numel == N
    assert {p: f.parts[p] for p in memory.PARTS if p != "other"} == {
        "params": 4 * N,
        "grads": 4 * N,
        "opt_state": 8 * N + STEP_BYTES,
        "masters": 0,
        "master_grads": 0,
    }
    assert 0 <= f.parts["other"] <= SMALL
    assert f.held_after_step == 16 * N + STEP_BYTES + f.parts["other"]
    assert f.after_zero_grad == f.held_after_step - 4 * N  # zero_grad(set_to_none=True) frees the grads
    assert f.temporaries <= SMALL  # torch's fused AdamW allocates nothing per param


def test_bf16_params_without_masters_hold_8_bytes_per_param():
    f = _measure(memory.TorchRecipe, torch.bfloat16)
    assert (f.parts["params"], f.parts["grads"], f.parts["opt_state"]) == (2 * N, 2 * N, 4 * N + STEP_BYTES)
    assert f.parts["masters"] == f.parts["master_grads"] == 0


@kernel_on
@pytest.mark.parametrize("flat", [False, True])
def test_the_kernel_holds_no_master_grad_memory(flat):
    f = _measure(lambda m: memory.MPORecipe(m, flat=flat), torch.float16)
    assert f.note == ""  # the kernel took the measured step
    assert (f.parts["params"], f.parts["grads"], f.parts["masters"]) == (2 * N, 2 * N, 4 * N)
    assert f.parts["master_grads"] == 0 and f.parts["opt_state"] == 8 * N + STEP_BYTES
    # the first step (no Adam state yet: torch's ops) made fp32 master grads -- per tensor the spares of the large
    # ones, flat the whole grad buffer; the kernel's step let them go (MasterParams.release_grad_memory)
    assert 0 <= f.parts["other"] <= SMALL
    assert f.held_after_step <= 16 * N + SMALL + STEP_BYTES


def test_spare_master_grads_are_counted_as_held_after_zero_grad():
    f = _measure(memory.FP16OptimizerRecipe, torch.float16)
    assert f.parts["master_grads"] == 4 * N  # FP16_Optimizer keeps its fp32 master grads after the step
    freed = 2 * N  # zero_grad(set_grads_to_None=True) frees the fp16 model grads ...
    freed += 4 * N - _spared()  # ... and the master grads of the small tensors; the spares stay held
    assert f.after_zero_grad == f.held_after_step - freed


def test_amp_o2_counts_its_masters_and_their_spares():
    f = _measure(memory.AmpO2Recipe, torch.float32)
    # amp sets the master grads to None after its step; the spares of the large ones stay held
    assert (f.parts["params"], f.parts["masters"], f.parts["master_grads"]) == (2 * N, 4 * N, 0)
    assert _spared() <= f.parts["other"] <= _spared() + SMALL


class _Scratch(torch.optim.Optimizer):
    """SGD that allocates a known scratch buffer in its step and frees it before returning."""

    SCRATCH = 1 << 16  # float32 elements

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        scratch = torch.ones(self.SCRATCH)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])
        del scratch


class _ScratchRecipe(memory.Recipe):
    def __init__(self, model: nn.Module) -> None:
        self.model, self.params = model, list(model.parameters())
        self.optimizer = _Scratch(self.params)

    def iteration(self, x, window):
        self.model(x).pow(2).mean().backward()
        window.begin()
        self.optimizer.step()
        window.end()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


def test_the_peak_sees_a_temporary_allocated_in_the_step():
    f = _measure(_ScratchRecipe, torch.float32)
    scratch = 4 * _Scratch.SCRATCH
    assert f.step_start == f.held_after_step  # nothing of the step is held after it
    assert scratch <= f.temporaries <= scratch + SMALL
    assert f.peak == f.step_start + f.temporaries


def test_the_timeline_leaves_out_frees_of_memory_from_before_the_run():
    old = [torch.ones(1 << 16) for _ in range(4)]  # allocated under an earlier profiler: their sizes are known
    first = _measure(memory.TorchRecipe, torch.float32)

    def make(model):
        old.clear()  # freed inside the next run
        return memory.TorchRecipe(model)

    assert _measure(make, torch.float32).held_after_step == first.held_after_step


def test_measure_needs_two_steps():
    with pytest.raises(ValueError, match="steps must be >= 2"):
        memory.measure(memory.TorchRecipe, lambda: TINY.build(torch.float32, "cpu"), torch.ones(1, 256), steps=1)


def test_quick_run_has_every_row_and_the_stated_anchors(monkeypatch):
    monkeypatch.setattr(memory, "memory_model", lambda quick: TINY)
    result = run_bench(rows=["memory"], quick=True)
    runnable, skipped = memory.recipes_for(torch.device("cpu"))
    assert [f.variant for f in result.memory] == [s.label(torch.device("cpu")) for s in runnable]
    assert len(runnable) + len(skipped) == len(memory.RECIPES)
    assert result.figures == [] and result.counts == []
    for f in result.memory:
        assert f.held_after_step >= sum(f.parts[p] for p in memory.PARTS if p != "other") > 0, f.variant
        assert f.peak >= max(f.step_start, f.held_after_step) and f.temporaries >= 0, f.variant
    text = to_markdown(result)
    assert "## memory (cpu): training-state bytes per param, AdamW, tiny" in text
    assert "| fp32 model + torch AdamW(fused=True) | 4.00 | 4.00 | 8.00 | 0.00 | 0.00 | 0.00 | 16.00 | 12.00 |" in text
    assert "| stated [1]: DeepSpeed ZeRO stage 0, mixed-precision Adam |" in text
    assert "Measured with: torch.profiler(profile_memory=True)" in text
    data = json.loads(to_json(result))
    assert {m["variant"] for m in data["memory"]} == {f.variant for f in result.memory}
    assert {s["kind"] for s in data["memory_stated"]} == {"stated"} and len(data["memory_stated"]) == len(memory.STATED)
    fp32 = data["memory"][0]
    assert fp32["bytes_per_param"]["held_after_step"] == pytest.approx(16, abs=0.01)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_cuda_rows_are_skipped_without_cuda():
    result = run_bench(rows=["memory"], devices=["cuda"], quick=True)
    assert result.memory == []
    assert result.skipped == [{"row": "memory", "device": "cuda", "reason": "no CUDA device"}]
    assert "## memory" not in to_markdown(result)


def test_cuda_leaves_out_the_cpu_kernel_rows():
    runnable, skipped = memory.recipes_for(torch.device("cuda"))
    assert skipped == [] and runnable and not any(s.kernel for s in runnable)
    assert any("autocast(fp16)" in s.label(torch.device("cuda")) for s in runnable)
