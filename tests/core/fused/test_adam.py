"""The fused master Adam/AdamW kernel against torch's fused Adam/AdamW on the fp32 masters, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from fp16kit.core import fused
from fp16kit.core.fused import adam

pytestmark = pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")

SIZES = [1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 4096 + 9, 70_001, (1 << 16) + 3, 3 * (1 << 16)]


def _world(dtype: torch.dtype, sizes: list[int], seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p16 = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    grads = [[(torch.randn(s, generator=g) * 500).to(dtype) for s in sizes] for _ in range(4)]
    return p16, grads


def _planned(p16: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.optim.Optimizer, fused.AdamPlan]:
    """Masters of ``p16``, torch's fused AdamW on them after one step at zero grads (its state), and their plan."""
    masters = [p.float() for p in p16]
    opt = torch.optim.AdamW(masters, fused=True)
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt.step()
    return masters, opt, fused.AdamPlan(p16, masters, opt)


def _torch_run(cls, p16, grads, kwargs, scale, found_infs):
    """torch's fused optimizer on fp32 masters, then the copy into the 16-bit params: the reference."""
    params = [p.clone() for p in p16]
    masters = [p.float() for p in params]
    opt = cls(masters, fused=True, **kwargs)
    for it, gs in enumerate(grads):
        for m, g in zip(masters, gs):
            m.grad = g.float()
        opt.grad_scale = torch.tensor(scale) if scale is not None else None
        opt.found_inf = torch.tensor(found_infs[it])
        opt.step()
        del opt.grad_scale, opt.found_inf
        torch._foreach_copy_(params, masters)
    return params, masters, opt


def _kernel_run(cls, p16, grads, kwargs, scale, found_infs, threads=None):
    params = [p.clone() for p in p16]
    masters = [p.float() for p in params]
    opt = cls(masters, fused=True, **kwargs)
    # the first step by torch creates the state (as the optimizer does before the kernel takes over)
    for m, g in zip(masters, grads[0]):
        m.grad = g.float()
    opt.grad_scale, opt.found_inf = (torch.tensor(scale) if scale is not None else None), torch.tensor(found_infs[0])
    opt.step()
    del opt.grad_scale, opt.found_inf
    torch._foreach_copy_(params, masters)
    for m in masters:
        m.grad = None
    plan = fused.AdamPlan(params, masters, opt)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for it, gs in enumerate(grads[1:], 1):
            found = torch.tensor(found_infs[it])
            plan.step(plan.grads(gs), opt.param_groups[0], grad_scale=torch.tensor(scale) if scale else None,
                      found_inf=found)  # fmt: skip
    finally:
        torch.set_num_threads(old)
    return params, masters, opt


def _assert_same(mine, ref):
    (p_a, m_a, o_a), (p_b, m_b, o_b) = mine, ref
    for a, b in zip(p_a, p_b):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(m_a, m_b):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            x, y = o_a.state[a][key], o_b.state[b][key]
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), key


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
        (torch.optim.AdamW, dict(lr=3e-3, betas=(0.3, 0.9), eps=1e-6, weight_decay=0.1)),  # lerp weight >= 0.5
        (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),  # L2 weight decay
        (torch.optim.Adam, dict(lr=1e-3)),  # none
    ],
    ids=["adamw", "adamw-small-beta1", "adam-l2", "adam"],
)
def test_bit_for_bit_torch_fused_on_the_masters(dtype, cls, kwargs):
    p16, grads = _world(dtype, SIZES)
    found = [0.0, 0.0, 1.0, 0.0]  # the third step skipped: nothing changes, steps neither
    ref = _torch_run(cls, p16, grads, kwargs, 1024.0, found)
    _assert_same(_kernel_run(cls, p16, grads, kwargs, 1024.0, found), ref)
    _assert_same(_kernel_run(cls, p16, grads, kwargs, 1024.0, found, threads=1), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("skipped", [False, True], ids=["stepped", "skipped"])
def test_land_writes_the_masters_as_they_were_before_the_step(dtype, skipped):
    # an inline asynchronous job: the landing of the step before (param16.copy_(master)) and this step, one pass
    p16, grads = _world(dtype, SIZES, seed=3)
    masters, opt, plan = _planned(p16)
    torch._foreach_mul_(masters, 1.0 + 1e-3)  # (masters that differ from the params, as after a job)
    before = [m.clone() for m in masters]
    ref_masters = [m.clone() for m in masters]
    ref = torch.optim.AdamW(ref_masters, fused=True)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # (not aliasing the state the plan steps)
    for m, g in zip(ref_masters, grads[0]):
        m.grad = g.float()
    found = torch.tensor(1.0 if skipped else 0.0)
    ref.grad_scale, ref.found_inf = torch.tensor(256.0), found.clone()
    ref.step()
    stepped = plan.step(
        plan.grads(grads[0]), opt.param_groups[0], grad_scale=torch.tensor(256.0), found_inf=found, land=True
    )
    assert stepped is not skipped
    for p, b in zip(p16, before):  # what the landing's copy writes, bit for bit
        assert torch.equal(p.view(torch.int16), b.to(dtype).view(torch.int16))
    for m, r in zip(masters, ref_masters):  # and the step torch's would take (none when skipped)
        assert torch.equal(m.view(torch.int32), r.view(torch.int32))
        assert torch.equal(opt.state[m]["step"], ref.state[r]["step"])


def test_unscaled_grads_and_no_flag():
    p16, grads = _world(torch.bfloat16, SIZES[:6], seed=3)
    grads = [[g / 512 for g in gs] for gs in grads]
    kwargs = dict(lr=1e-2, weight_decay=0.01)
    ref = _torch_run(torch.optim.AdamW, p16, grads, kwargs, None, [0.0] * 4)
    _assert_same(_kernel_run(torch.optim.AdamW, p16, grads, kwargs, None, [0.0] * 4), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 16, 4096 + 8, 65536 + 37, -1])
def test_check_finite_finds_every_non_finite_value_anywhere(dtype, bad, where):
    p16, grads = _world(dtype, [1, 17, 4096 + 9, 70_001])
    masters, opt, plan = _planned(p16)
    gs = grads[0]
    found = torch.zeros(())
    fused.check_finite_(plan, plan.grads(gs), found)
    assert found.item() == 0.0
    victim = 3 if where else 0  # (size 1: index 0 or -1)
    gs[victim].view(-1)[where] = bad
    fused.check_finite_(plan, plan.grads(gs), found)
    assert found.item() == 1.0
    # only ever set: clean grads leave a raised flag raised
    gs[victim].view(-1)[where] = 0
    fused.check_finite_(plan, plan.grads(gs), found)
    assert found.item() == 1.0


def test_the_largest_finite_values_are_finite():
    p16 = [torch.zeros(40, dtype=torch.float16), torch.zeros(40, dtype=torch.bfloat16)]
    for p in p16:
        _, _, plan = _planned([p])
        g = torch.full((40,), torch.finfo(p.dtype).max, dtype=p.dtype)
        g[::2] = -torch.finfo(p.dtype).max
        found = torch.zeros(())
        fused.check_finite_(plan, plan.grads([g]), found)
        assert found.item() == 0.0


def test_a_missing_or_strided_grad_means_torch_s_ops():
    p16, grads = _world(torch.float16, [6, 12])
    masters, opt, plan = _planned(p16)
    assert plan.grads([grads[0][0], None]) is None
    strided = torch.zeros(24, dtype=torch.float16)[::2]
    assert plan.grads([grads[0][0], strided]) is None
    with pytest.raises(fused.PlanMismatch, match="1 grads for a plan of 2"):
        plan.grads([grads[0][0]])


def test_a_replaced_state_is_refused_before_anything_is_written():
    p16, grads = _world(torch.float16, [6, 12])
    masters, opt, plan = _planned(p16)
    opt.load_state_dict(opt.state_dict())  # new state tensors
    before = [m.clone() for m in masters]
    with pytest.raises(fused.PlanMismatch, match="load_state_dict"):
        plan.step(plan.grads(grads[0]), opt.param_groups[0], grad_scale=None, found_inf=None)
    assert all(torch.equal(a, b) for a, b in zip(before, masters))
    assert fused.AdamPlan(p16, masters, opt).current()


def test_plans_refuse_tensors_the_kernel_cannot_address():
    p = torch.zeros(4, dtype=torch.float16)
    m = p.float()
    opt = torch.optim.AdamW([m], fused=True)
    with pytest.raises(ValueError, match="state of every master"):
        fused.AdamPlan([p], [m], opt)
    m.grad = torch.zeros_like(m)
    opt.step()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fused.AdamPlan([p.float()], [m], opt)
    with pytest.raises(ValueError, match="param is torch.float16 .* with 8 elements"):
        fused.AdamPlan([torch.zeros(8, dtype=torch.float16)], [m], opt)
    with pytest.raises(ValueError, match=r"one 16-bit param \(or None\) per master"):
        fused.AdamPlan([], [], opt)


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda ps: torch.optim.AdamW(ps), "fused=True"),
        (lambda ps: torch.optim.AdamW(ps, fused=True, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.Adam(ps, fused=True, maximize=True), "maximize"),
        (lambda ps: torch.optim.AdamW(ps, fused=True, lr=torch.tensor(0.01)), "tensor"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "not torch.optim.Adam"),
        (lambda ps: type("MyAdamW", (torch.optim.AdamW,), {})(ps, fused=True), "MyAdamW is not"),
    ],
)
def test_what_the_kernel_refuses(make, why):
    opt = make([torch.zeros(3, requires_grad=True)])
    assert why in adam.kernel_refusal(opt, opt.param_groups[0])


def test_adam_and_adamw_with_fused_true_are_taken():
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        opt = cls([torch.zeros(3, requires_grad=True)], fused=True)
        assert adam.kernel_refusal(opt, opt.param_groups[0]) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_from_fp32_grads_with_fp32_params_stepped_in_place(dtype, cls):
    """apex's faces: the masters' own unscaled fp32 grads, fp32 params (no 16-bit copy) in the same plan."""
    sizes = [1, 7, 16, 33, 4096 + 9, 70_001]
    p16, grads = _world(dtype, sizes, seed=5)
    fp32 = [0, 3]  # these params are fp32 in the model: stepped as they are
    kwargs = dict(lr=1e-2, weight_decay=0.05)

    def world():
        params = [p.float().clone() if i in fp32 else p.clone() for i, p in enumerate(p16)]
        masters = [p if i in fp32 else p.float() for i, p in enumerate(params)]
        opt = cls(masters, fused=True, **kwargs)
        return params, masters, opt

    def attach(masters, gs):
        for m, g in zip(masters, gs):
            m.grad = (g.float() / 512).contiguous()

    ref_params, ref_masters, ref_opt = world()
    params, masters, opt = world()
    for it, gs in enumerate(grads):
        found = torch.tensor(1.0 if it == 2 else 0.0)  # the third step skipped
        attach(ref_masters, gs)
        ref_opt.found_inf = found
        ref_opt.step()
        del ref_opt.found_inf
        torch._foreach_copy_([p for i, p in enumerate(ref_params) if i not in fp32],
                             [m for i, m in enumerate(ref_masters) if i not in fp32])  # fmt: skip
        attach(masters, gs)
        if it == 0:  # the first step is torch's: it makes the state
            opt.step()
            torch._foreach_copy_([p for i, p in enumerate(params) if i not in fp32],
                                 [m for i, m in enumerate(masters) if i not in fp32])  # fmt: skip
            plan = fused.AdamPlan([None if i in fp32 else p for i, p in enumerate(params)], masters, opt)
            assert plan.grads([p.grad for p in p16]) is None  # 16-bit grads: not with fp32 params in the plan
            continue
        before = [m.grad.clone() for m in masters]
        plan.step(plan.grads([m.grad for m in masters], fp32=True), opt.param_groups[0], grad_scale=None,
                  found_inf=found)  # fmt: skip
        assert all(torch.equal(m.grad, b) for m, b in zip(masters, before))  # the grads are read, not written
    for i, (a, b) in enumerate(zip(params, ref_params)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16 if i not in fp32 else torch.int32),
                                                  b.view(torch.int16 if i not in fp32 else torch.int32))  # fmt: skip
    _assert_same(([], masters, opt), ([], ref_masters, ref_opt))


def test_fp32_grads_are_refused_by_the_check():
    p16, grads = _world(torch.float16, [8])
    masters, opt, plan = _planned(p16)
    addresses = plan.grads([grads[0][0].float()], fp32=True)
    assert addresses is not None
    assert plan.grads([grads[0][0].float()]) is None  # (16-bit expected)
    assert plan.grads([grads[0][0]], fp32=True) is None  # (float32 expected)
    with pytest.raises(ValueError, match="16-bit grads"):
        fused.check_finite_(plan, addresses, torch.zeros(()))
