"""fp16kit.bench.trace: the bytes, ops and host reads one iteration is counted to make."""

from __future__ import annotations

import pytest
import torch

from fp16kit.bench import trace

N = 1000


def test_copy_into_fp32_moves_6_bytes_per_element():
    src = [torch.ones(N, dtype=torch.float16)]
    dst = [torch.empty(N)]
    t = trace.op_tally(lambda: torch._foreach_copy_(dst, src))
    assert (t.read, t.written, t.ops) == (2 * N, 4 * N, 1)


def test_check_and_unscale_reads_and_writes_its_tensors():
    g = [torch.ones(N)]
    found_inf, inv = torch.zeros(()), torch.ones(())
    t = trace.op_tally(lambda: torch._amp_foreach_non_finite_check_and_unscale_(g, found_inf, inv))
    assert t.moved == 8 * N + 3 * 4  # + the flag (read, written) and inv_scale (read)


@pytest.mark.parametrize("grad_scale, per_param", [(None, 28), (torch.tensor(2.0), 32)])
def test_fused_adamw_writes_its_grads_only_when_it_unscales_them(grad_scale, per_param):
    p = torch.nn.Parameter(torch.ones(N))
    p.grad = torch.ones(N)
    opt = torch.optim.AdamW([p], fused=True)
    opt.step()  # the state exists
    opt.grad_scale = grad_scale
    t = trace.op_tally(opt.step)
    assert t.moved // N == per_param  # (+ the step counter and the scalars: a few bytes)


def test_a_functional_op_writes_its_output_and_views_move_nothing():
    x = torch.ones(N)
    t = trace.op_tally(lambda: (x * 2, x.view(10, 100), x.detach(), torch.empty_like(x)))
    assert (t.read, t.written) == (4 * N, 4 * N)
    assert t.ops == 4


def test_host_reads_counted_on_this_thread():
    x = torch.ones(3)

    def reads():
        x.sum().item()
        bool(x.all())
        float(x[0])
        x.tolist()

    assert trace.op_tally(reads).host_reads == 4
    assert trace.op_tally(lambda: x + 1).host_reads == 0
    assert torch.Tensor.tolist is not None and "tolist" in torch.Tensor.tolist.__qualname__  # put back


def test_python_calls_leave_the_bench_frames_out():
    from fp16kit.bench.timing import ratios

    def outer():  # frames of this file: counted
        return inner()

    def inner():
        return 1

    assert trace.python_calls(outer) == 2
    assert trace.python_calls(lambda: ratios([1.0], [1.0])) == 1  # the lambda; not the bench's own frames


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_syncs_counts_an_item():
    x = torch.ones(3, device="cuda")
    assert trace.cuda_syncs(lambda: x.sum().item()) >= 1
    assert trace.cuda_syncs(lambda: x + 1) == 0


def test_the_fused_kernel_counts_its_own_traffic():
    from fp16kit.core import fused

    if fused.forms() is None:
        pytest.skip("the fused Adam kernel is off on this machine")
    p16 = [torch.zeros(1000, dtype=torch.float16), torch.zeros(24, dtype=torch.float16)]
    masters = [p.float() for p in p16]
    opt = torch.optim.AdamW(masters, fused=True)
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt.step()
    plan = fused.AdamPlan(p16, masters, opt)
    grads = plan.grads([torch.ones(1000, dtype=torch.float16), torch.ones(24, dtype=torch.float16)])
    group = opt.param_groups[0]
    found = torch.zeros(())
    assert trace.op_tally(lambda: fused.check_finite_(plan, grads, found)).moved == 2 * 1024
    addresses = 2 * 2 * 8  # the step copies the grads' addresses into its table: 2 int64 read and written
    assert trace.op_tally(lambda: plan.step(grads, group, grad_scale=None, found_inf=found)).moved == (
        28 * 1024 + addresses
    )
    found.fill_(1.0)  # a skipped step moves nothing
    assert trace.op_tally(lambda: plan.step(grads, group, grad_scale=None, found_inf=found)).moved == addresses
