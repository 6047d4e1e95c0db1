"""fp16kit.integrations.lightning.fabric: MasterWeightsFabricPrecision against the plain loop.

The reference is the plain fp16kit loop written out (model.half()/bfloat16(),
MixedPrecisionOptimizer, fp16kit.GradScaler, torch's clip_grad_norm_ on the masters). Fabric
adds no arithmetic on this path, so params and masters must be equal bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="the Lightning adapter needs lightning: pip install 'fp16kit[lightning]'")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.lightning.fabric import MasterWeightsFabricPrecision  # noqa: E402

LR, CLIP, STEPS, INF_STEP = 0.05, 0.5, 5, 2
DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(STEPS)]


def loss_of(out, y, k):
    loss = (out.float() - y.float()).pow(2).mean()
    return loss * float("inf") if k == INF_STEP else loss


def fabric_run(precision, *, async_step=False, clip=True, data=None, state=None):
    plugin = MasterWeightsFabricPrecision(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with fabric.init_module():
        model = net()
    opt = fp16kit.MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), async_step=async_step
    )
    model, opt = fabric.setup(model, opt)
    norms, skipped = [], []
    for k, (x, y) in enumerate(data if data is not None else batches()):
        opt.zero_grad()
        fabric.backward(loss_of(model(x), y, k))  # inputs converted by Fabric's module wrapper
        if clip:
            norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False))
        opt.step()
        skipped.append(plugin.scaler.last_step_skipped() if plugin.scaler is not None else None)
    opt.synchronize()
    return model, opt, plugin, norms, skipped


def reference(precision, *, async_step=False, clip=True):
    model = net().to(DTYPES[precision])
    opt = fp16kit.MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), async_step=async_step
    )
    scaler = fp16kit.GradScaler("cpu") if precision == "16-true" else None
    norms = []
    for k, (x, y) in enumerate(batches()):
        opt.zero_grad()
        loss = loss_of(model(x.to(DTYPES[precision])), y, k)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(opt.master_params, CLIP))
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if clip:
                norms.append(opt.clip_grad_norm_(CLIP))
            opt.step()
    opt.synchronize()
    return model, opt, norms


@pytest.mark.parametrize("precision,async_step", [("16-true", False), ("16-true", True), ("bf16-true", False)])
def test_equals_plain_loop_bit_for_bit(precision, async_step):
    model, opt, plugin, norms, skipped = fabric_run(precision, async_step=async_step)
    ref, ref_opt, ref_norms = reference(precision, async_step=async_step)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(m, r) for m, r in zip(opt.master_params, ref_opt.master_params))
    if precision == "16-true":
        assert skipped == [k == INF_STEP for k in range(STEPS)]
        assert plugin.scaler.get_scale() == 65536.0 / 2
        # the unscaled norm, from the same computation (the overflow step's is inf in both)
        assert all(torch.equal(n, r) for n, r in zip(norms, ref_norms) if torch.isfinite(r))


def test_optimizer_built_before_the_cast_is_refused():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MasterWeightsFabricPrecision()])
    model = net()  # fp32: the optimizer gets no masters, then fabric.setup casts the params
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    model, opt = fabric.setup(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    fabric.backward(loss_of(model(torch.randn(2, 8)), torch.zeros(2, 4), 0))
    with pytest.raises(TypeError, match="init_module"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with pytest.raises(TypeError, match="fp16kit.GradScaler"):
        MasterWeightsFabricPrecision(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="no scaler"):
        MasterWeightsFabricPrecision("bf16-true", scaler=fp16kit.GradScaler("cpu"))


def test_save_and_load_resume_bit_for_bit(tmp_path):
    data = batches()
    full = fabric_run("16-true", data=data)

    plugin = MasterWeightsFabricPrecision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])

    def setup():
        with fabric.init_module():
            model = net()
        opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        return fabric.setup(model, opt)

    def train(model, opt, ks):
        for k in ks:
            x, y = data[k]
            opt.zero_grad()
            fabric.backward(loss_of(model(x), y, k))
            fabric.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)
            opt.step()

    model, opt = setup()
    train(model, opt, range(3))  # through the overflow
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "scaler": plugin.scaler})
    plugin.scaler = fp16kit.GradScaler("cpu")  # fresh objects
    model, opt = setup()
    fabric.load(tmp_path / "ckpt", {"model": model, "optimizer": opt, "scaler": plugin.scaler})
    assert plugin.scaler.get_scale() == 65536.0 / 2
    train(model, opt, range(3, STEPS))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), full[0].parameters()))
    assert all(torch.equal(m, r) for m, r in zip(opt.master_params, full[1].master_params))


def test_fabric_mixed_precision_with_half_model_and_user_mpo():
    # the hand-assembled path: Fabric's own MixedPrecision (autocast) with fp16kit.GradScaler; a
    # .half() model and a MixedPrecisionOptimizer: fabric.clip_gradients reaches the masters
    from lightning.fabric.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=fp16kit.GradScaler("cpu"))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = net().half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    model, opt = fabric.setup(model, opt)
    ref = net().half()
    ref_opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9))
    scaler = fp16kit.GradScaler("cpu")
    for k, (x, y) in enumerate(batches()):
        opt.zero_grad()
        fabric.backward(loss_of(model(x), y, k))
        fabric.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)
        opt.step()
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(ref(x.half()), y, k)  # (Fabric converts the inputs to fp16 too)
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_opt.master_params, CLIP)
        scaler.step(ref_opt)
        scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert plugin.scaler.skipped_steps() == 1


def _two_step_reference(gan):
    with torch.device("cpu"):
        model = net().half()
    pa = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model[0].parameters(), lr=LR))
    pb = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model[2].parameters(), lr=LR))
    sc = fp16kit.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    skipped = []
    for k, (x, y) in enumerate(batches()):
        pa.zero_grad()
        pb.zero_grad()
        sc.scale(loss_of(model(x.half()), y, k)).backward()
        sc.step(pa)
        skipped.append(sc.last_step_skipped())
        if gan:
            sc.update()
            pb.zero_grad()
            sc.scale(loss_of(model(x.half()), y, -1)).backward()
        sc.step(pb)
        sc.update()
    return model, (pa, pb), sc, skipped


@pytest.mark.parametrize("gan", [False, True], ids=["one_backward", "backward_per_optimizer"])
def test_two_optimizers_update_the_scale_once_per_iteration(gan):
    """One backward, two optimizers (two param subsets): torch.amp's rule, step both then update
    once; with a backward per optimizer (GAN-style) the update runs between them."""
    plugin = MasterWeightsFabricPrecision(scaler=fp16kit.GradScaler("cpu", init_scale=1024.0, growth_interval=1))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with fabric.init_module():
        model = net()
    oa = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model[0].parameters(), lr=LR))
    ob = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model[2].parameters(), lr=LR))
    model, oa, ob = fabric.setup(model, oa, ob)
    skipped = []
    for k, (x, y) in enumerate(batches()):
        oa.zero_grad()
        ob.zero_grad()
        fabric.backward(loss_of(model(x), y, k))
        oa.step()
        skipped.append(plugin.scaler.last_step_skipped())
        if gan:
            ob.zero_grad()
            fabric.backward(loss_of(model(x), y, -1))
        ob.step()
    plugin.settle_scale()
    ref, (pa, pb), sc, ref_skipped = _two_step_reference(gan)
    assert skipped == ref_skipped and skipped[INF_STEP]
    assert plugin.scaler.get_scale() == sc.get_scale()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    for o, r in ((oa, pa), (ob, pb)):
        assert all(torch.equal(m, n) for m, n in zip(o.master_params, r.master_params))
