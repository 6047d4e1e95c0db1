"""scale(), unscale_() and update() never read a tensor on the host (DESIGN.md rule 2).

On CPU a host read is cheap, but the same code runs on CUDA, where each read is a device sync.
So we forbid the Python entry points of a host read (item, bool, float, int, index, tolist,
numpy) while the scaler works, and let only the documented sync points (the skip decision of
a non-fused step, get_scale) through. On CUDA, torch's own sync detector checks the same.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import fp16kit

READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads(monkeypatch, *, main_thread_only=False):
    """Forbid host reads; with ``main_thread_only`` only on the main thread (the optimizer
    thread may read the device)."""

    def allowed():
        return main_thread_only and threading.current_thread() is not threading.main_thread()

    with monkeypatch.context() as m:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def forbidden(self, *a, __name=name, __original=original, **k):
                if allowed():
                    return __original(self, *a, **k)
                raise HostRead(f"Tensor.{__name} called on the hot path")

            m.setattr(torch.Tensor, name, forbidden)

        torch_equal = torch.equal

        def equal(*a, **k):
            if allowed():
                return torch_equal(*a, **k)
            raise HostRead("torch.equal called on the hot path")

        m.setattr(torch, "equal", equal)
        yield


def _setup(fused: bool, **scaler_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), fused=fused) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fp16kit.GradScaler("cpu", growth_interval=2, **scaler_kwargs)
    return model, opt, scaler


@pytest.mark.parametrize(
    "scaler_kwargs",
    [{}, {"hysteresis": 2, "min_scale": 1.0, "max_scale": 2.0**20}],
    ids=["torch-rule", "extras"],
)
def test_scale_unscale_update_do_not_read_the_device(monkeypatch, scaler_kwargs):
    model, opt, scaler = _setup(False, **scaler_kwargs)
    for i in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        with no_host_reads(monkeypatch):
            scaled = scaler.scale(loss)
            scaled_list = scaler.scale([loss, (loss,)])
        scaled.backward()
        if i == 1:
            model[0].weight.grad[0, 0] = float("inf")
        with no_host_reads(monkeypatch):
            scaler.unscale_(opt)
            skipped = scaler.last_step_skipped_tensor()
        scaler.step(opt)  # the non-fused skip decision is the documented sync (torch's too)
        with no_host_reads(monkeypatch):
            scaler.update()
            scaler.last_step_skipped_tensor()
        assert bool(skipped) == (i == 1)
        assert isinstance(scaled_list, list)
    assert scaler.skipped_steps() == 1


def test_fused_step_is_sync_free_end_to_end(monkeypatch):
    model, opt, scaler = _setup(True)
    for i in range(3):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        if i == 2:
            model[2].bias.grad[0] = float("nan")
        with no_host_reads(monkeypatch):
            scaler.step(opt)  # fused Adam takes found_inf on the device and skips there
            scaler.update()
    assert scaler.skipped_steps() == 1


def test_the_guard_itself_catches_reads(monkeypatch):
    with no_host_reads(monkeypatch):
        with pytest.raises(HostRead):
            torch.ones(()).item()
        with pytest.raises(HostRead):
            bool(torch.ones(()))
    assert torch.ones(()).item() == 1.0  # restored


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sync_debug_mode():
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = fp16kit.GradScaler("cuda", hysteresis=2, min_scale=1.0)
    for _i in range(3):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 64, device="cuda")).float().pow(2).mean()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert scaler.get_scale() > 0


def test_sparse_grads_and_fp16_masters_do_not_read_the_device(monkeypatch):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    head = torch.nn.Linear(4, 2).half()
    sparse_opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    mp_opt = fp16kit.MixedPrecisionOptimizer(torch.optim.Adam(head.parameters(), fused=True))
    scaler = fp16kit.GradScaler("cpu", init_scale=256.0)
    for _ in range(2):
        sparse_opt.zero_grad()
        mp_opt.zero_grad()
        loss = head(emb(torch.tensor([1, 2, 3])).half()).float().sum()
        with no_host_reads(monkeypatch):
            scaled = scaler.scale(loss)
        scaled.backward()
        with no_host_reads(monkeypatch):
            scaler.unscale_(sparse_opt)
            scaler.step(mp_opt)  # fp16 grads -> fp32 masters, fused step: no host read
        scaler.step(sparse_opt)
        with no_host_reads(monkeypatch):
            scaler.update()
    assert scaler.skipped_steps() == 0


@pytest.mark.parametrize("face", ["MixedPrecisionOptimizer", "FP16_Optimizer"])
def test_asynchronous_steps_never_read_the_device_on_the_main_thread(monkeypatch, face):
    # Mode 1: the check, the scale update and the hand-off stay on the device; only the
    # optimizer thread reads the skip flag. An overflow in iteration 2 exercises the skip.
    from fp16kit.legacy import FP16_Optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).half()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    if face == "FP16_Optimizer":
        opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False, async_step=True, async_policy="thread")
    else:  # (inline steps read the skip flag on the main thread: async_policy)
        opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=True, async_policy="thread")
        scaler = fp16kit.GradScaler("cpu", growth_interval=2)
    for i in range(5):
        opt.zero_grad()
        loss = model(torch.randn(4, 8).half()).float().pow(2).mean()
        with no_host_reads(monkeypatch, main_thread_only=True):
            if face == "FP16_Optimizer":
                opt.backward(loss, update_master_grads=False)
                if i == 2:
                    model[0].weight.grad.view(-1)[0] = float("inf")
                opt.update_master_grads()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if i == 2:
                    model[0].weight.grad.view(-1)[0] = float("inf")
                scaler.step(opt)
                scaler.update()
    opt.synchronize()
    if face == "FP16_Optimizer":
        assert opt.loss_scale == 2.0**15  # one back-off (the window is 2000)
    else:
        assert scaler.get_scale() == 2.0**17  # grown at 1, backed off at 2, grown at 4
