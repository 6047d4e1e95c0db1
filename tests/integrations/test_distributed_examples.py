"""The torch.distributed examples (examples/integrations/ddp_*.py, fsdp2_*.py) run as a user runs
them -- ``python <script>``, which spawns 2 gloo ranks on 127.0.0.1 itself -- and print what they
claim. The DDP example's printed losses and grad norms are checked against the plain fp16kit loop
written out here: one process on both ranks' batches concatenated (equal halves, so the mean loss
and the mean grad are the ranks' averages), same model, optimizer, clipping, scheduler, gradient
accumulation and the same overflow step skipped; synchronous, and async_step=True with 2
micro-batches under ddp.no_sync() (the plain async loop, with the same one-step delay). DDP
averages two fp16 grads where one backward over the whole batch sums in another order, so the
grads differ by fp16 roundings: the comparison allows half an fp16 ulp (5e-4, relative for the
norms; measured: <= 7e-5) where the print has 1e-5 resolution.
The FSDP2 example's printed losses and norms are checked against FSDP2's arithmetic written out
(fp16 copies of the fp32 params per rank, fp32 grad average, unscale, clip, AdamW), within the
same half fp16 ulp. tests/integrations/test_ddp.py tests the same behaviour bit for bit between
the ranks."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import fp16kit

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

from _helpers.gloo import ROOT  # noqa: E402

EXAMPLES = ROOT / "examples" / "integrations"
STEP = re.compile(r"step (\d+)  loss ([\d.]+)  grad-norm (\S+)  scale (\S+)  skipped (True|False)")


def _run(name: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, env=env, timeout=120
    )
    if done.returncode != 0:
        # as tests/_helpers/gloo.py: a rank sometimes aborts in teardown after its work is done
        # ("terminate called without an active exception"; torch/gloo's, also with torch.amp).
        # The example's last line is printed after every collective but the final barrier.
        assert "terminate called without an active exception" in done.stderr, done.stderr
        assert done.stdout.rstrip().endswith("True"), done.stdout + done.stderr
    return done.stdout


def _steps(out: str) -> list[tuple[int, float, float, float, bool]]:
    return [
        (int(s), float(loss), float(norm), float(scale), skipped == "True")
        for s, loss, norm, scale, skipped in STEP.findall(out)
    ]


def _example_module(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() is behind __name__
    return module


def _plain_loop(async_step: bool, accumulate: int, steps: int, overflow_step: int) -> list[tuple]:
    ex = _example_module("ddp_master_weights.py")
    model = ex.build_model().half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), async_step=async_step)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**14)
    log = []
    for step in range(steps):
        opt.zero_grad()
        shown = 0.0
        for micro in range(accumulate):
            (x0, y0), (x1, y1) = (ex.batch(step * accumulate + micro, r) for r in range(2))
            loss = (model(torch.cat([x0, x1]).half()).float() - torch.cat([y0, y1])).pow(2).mean() / accumulate
            shown += loss.item()
            if step == overflow_step and micro == accumulate - 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(opt.master_params, 1.0)  # torch's, on the masters
        scaler.step(opt)
        scaler.update()
        sched.step()
        log.append((shown, norm.item(), scaler.get_scale(), scaler.last_step_skipped()))
    opt.synchronize()
    return log


@pytest.mark.slow
@pytest.mark.parametrize("async_step, accumulate", [(False, 1), (True, 2)], ids=["sync", "async-accumulate"])
def test_ddp_example_ranks_identical_and_matches_plain_loop(async_step, accumulate):
    out = _run(
        "ddp_master_weights.py",
        "--steps",
        "6",
        "--overflow-step",
        "2",
        "--accumulate",
        str(accumulate),
        *(["--async-step"] if async_step else []),
    )
    assert "ranks' params and masters bit-identical: True" in out, out
    assert "skipped steps per rank: [1, 1]" in out  # rank 1's inf made both ranks skip
    assert "model params ['torch.float16']" in out
    got = _steps(out)
    assert [s[0] for s in got] == list(range(6))
    want = _plain_loop(async_step, accumulate, 6, 2)
    for (step, loss, norm, scale, skipped), (ref_loss, ref_norm, ref_scale, ref_skipped) in zip(got, want):
        assert (scale, skipped) == (ref_scale, ref_skipped), step
        assert skipped == (step == 2)
        assert abs(loss - ref_loss) < 5e-4, (step, loss, ref_loss)
        if skipped:
            assert not torch.isfinite(torch.tensor(norm))  # the overflowed step's norm is inf/nan
        else:
            assert abs(norm - ref_norm) < 5e-4 * max(1.0, ref_norm), (step, norm, ref_norm)
    assert [s[3] for s in got] == [16384.0] * 2 + [8192.0] * 4  # printed after update()


def _fsdp2_reference(steps: int, overflow_step: int) -> list[tuple[float, float, float]]:
    """FSDP2's arithmetic written out: fp32 params; per rank an fp16 copy runs forward/backward of
    the scaled loss; the grads are averaged in fp32 (reduce_dtype), unscaled, clipped by their
    total norm, and AdamW steps the fp32 params; the overflow step is skipped, the scale halves."""
    ex = _example_module("fsdp2_grad_scaler.py")
    ref = ex.build_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    scale, log = 2.0**14, []
    for step in range(steps):
        losses, grads = [], []
        for rank in range(2):
            half = copy.deepcopy(ref).half()
            x, y = ex.batch(step, rank)
            loss = (half(x.half()).float() - y).pow(2).mean()
            (loss * scale).backward()
            losses.append(loss.item())
            grads.append([p.grad.float() for p in half.parameters()])
        if step == overflow_step:
            scale /= 2
            log.append((sum(losses) / 2, float("inf"), scale))
            continue
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = (g0 + g1) / 2 / scale
        norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        opt.step()
        log.append((sum(losses) / 2, norm.item(), scale))
    return log


@pytest.mark.slow
def test_fsdp2_example_ranks_skip_together_and_masters_are_refused():
    out = _run("fsdp2_grad_scaler.py", "--steps", "5", "--overflow-step", "1")
    assert (
        "MixedPrecisionOptimizer over FSDP2 shards refused: Do not combine them: FSDP2's "
        "MixedPrecisionPolicy already keeps the sharded params in float32"
    ) in out, out
    assert "compute dtype torch.float16; params: DTensor shards of torch.float32" in out
    got = _steps(out)
    assert [(s[0], s[3], s[4]) for s in got] == [
        (0, 16384.0, False),
        (1, 8192.0, True),
        (2, 8192.0, False),
        (3, 8192.0, False),
        (4, 8192.0, False),
    ]
    assert "skipped steps per rank: [1, 1]" in out  # only rank 1's shard had the inf
    assert "ranks skipped the same steps: True" in out
    # fp16 forward from the same fp32 weights; the grads' fp32 averaging order may differ
    for (step, loss, norm, scale, skipped), (ref_loss, ref_norm, ref_scale) in zip(got, _fsdp2_reference(5, 1)):
        assert scale == ref_scale
        assert abs(loss - ref_loss) < 5e-4, (step, loss, ref_loss)
        if skipped:
            assert not torch.isfinite(torch.tensor(norm))  # the overflowed step's norm is inf/nan
        else:
            assert abs(norm - ref_norm) < 5e-4 * max(1.0, ref_norm), (step, norm, ref_norm)
