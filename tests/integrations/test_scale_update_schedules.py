"""One backward, two optimizers, one of which steps only on some iterations (GAN and multi-task
loops): every adapter against the plain torch.amp-rule loop, written out in :func:`reference`::

    scaler.scale(loss).backward()                  # (a second loss: a second backward)
    scaler.unscale_(a); clip(a); scaler.step(a)    # in the schedule's order: b may come first
    if b steps this iteration: scaler.unscale_(b); clip(b); scaler.step(b)
    scaler.update()                                # once, after every optimizer that stepped

with :class:`fp16kit.GradScaler` and :class:`fp16kit.MixedPrecisionOptimizer`, compared bit for bit
(torch.equal): the model params, the masters, the scale each iteration's loss was scaled with, the
clipped (unscaled) norms, the scale after each iteration (Lightning: at ``on_train_batch_end``;
elsewhere where every optimizer stepped, so that one-optimizer loops read what they always read),
and the final scale. The scale grows at every clean update (``growth_interval=1``), so an update
run too early -- between two optimizers' steps of one backward -- changes the second optimizer's
grads and norm by the growth (or back-off) factor.

The HF Trainer has one optimizer, so these schedules do not apply to it: its update runs right
after each step (``test_transformers.py::test_fp16_accumulation_clipping_matches_plain_loop``
compares the scale after every step, with accumulation and an overflow, to the plain loop).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import pytest

pytest.importorskip("lightning", reason="the Lightning adapters need lightning: pip install 'fp16kit[lightning]'")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.lightning import MasterWeightsPrecision  # noqa: E402
from fp16kit.integrations.lightning.fabric import MasterWeightsFabricPrecision  # noqa: E402

LR, CLIP, ITERS, K = 0.05, 0.5, 8, 3


@dataclass(frozen=True)
class Plan:
    """One iteration: the optimizers that step, in order; the number of losses (one backward
    each, before any step); the optimizer whose model grads get an inf after the backward."""

    order: tuple[str, ...]
    backwards: int = 1
    inf: str | None = None


def every(it: int) -> Plan:
    return Plan(("a", "b"))


def b_every_kth_after_a(it: int) -> Plan:  # a, then b every k-th iteration: b first steps after a in iteration k-1
    return Plan(("a", "b") if (it + 1) % K == 0 else ("a",))


def b_every_kth_first(it: int) -> Plan:  # b steps before a on its iterations; its first step is late
    return Plan(("b", "a") if it % K == 1 else ("a",))


def overflow_skips_one(it: int) -> Plan:  # b's grads overflow where b steps (b skipped, a steps), a's where b does not
    return Plan(b_every_kth_first(it).order, inf={4: "b", 6: "a"}.get(it))


def second_backward(it: int) -> Plan:  # two losses, two backwards, then the steps
    return Plan(b_every_kth_first(it).order, backwards=2)


SCHEDULES = [every, b_every_kth_after_a, b_every_kth_first, overflow_skips_one, second_backward]
CASES = [pytest.param(s, False, id=s.__name__) for s in SCHEDULES] + [
    pytest.param(s, True, id=f"{s.__name__}-async") for s in (b_every_kth_first, overflow_skips_one, second_backward)
]


@pytest.fixture(autouse=True)
def _quiet():
    logs = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)  # banners and tips at every fit
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def reset_accelerate() -> None:
    """Accelerate's process-wide singletons, as a fresh process has them."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(n: int = ITERS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g).half(), torch.randn(5, 4, generator=g).half()) for _ in range(n)]


def inners(net: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """``a`` steps the first layer, ``b`` the last (one backward reaches both)."""
    return (
        torch.optim.SGD(net[0].parameters(), lr=LR, momentum=0.9),
        torch.optim.AdamW(net[2].parameters(), lr=LR / 10),
    )


def scaler() -> fp16kit.GradScaler:
    return fp16kit.GradScaler("cpu", init_scale=1024.0, growth_interval=1)


def losses(net, x, y, plan: Plan) -> list[torch.Tensor]:
    first = (net(x).float() - y.float()).pow(2).mean()
    return [first] if plan.backwards == 1 else [first, 0.1 * net(x).float().pow(2).mean()]


def inject(net: torch.nn.Module, plan: Plan) -> None:
    if plan.inf is not None:
        net[{"a": 0, "b": 2}[plan.inf]].weight.grad[0, 0] = math.inf


@dataclass
class Run:
    params: list[torch.Tensor]
    masters: list[torch.Tensor]
    used: list[float]  # the scale each iteration's losses were scaled with
    norms: list[torch.Tensor]  # each clip's (unscaled) norm, in step order
    after: dict[int, float]  # iteration -> the scale read after it
    final: float
    skipped: int


def reference(schedule, async_step: bool) -> Run:
    net = make_net().half()
    opts = dict(zip("ab", (fp16kit.MixedPrecisionOptimizer(i, async_step=async_step) for i in inners(net))))
    sc, used, norms, after = scaler(), [], [], {}
    for it, (x, y) in enumerate(batches()):
        plan = schedule(it)
        for opt in opts.values():
            opt.zero_grad()
        used.append(sc.get_scale())
        for loss in losses(net, x, y, plan):
            sc.scale(loss).backward()
        inject(net, plan)
        for name in plan.order:
            sc.unscale_(opts[name])
            norms.append(torch.nn.utils.clip_grad_norm_(opts[name].master_params, CLIP))
            sc.step(opts[name])
        sc.update()
        after[it] = sc.get_scale()
    for opt in opts.values():
        opt.synchronize()
    return Run(
        list(net.parameters()),
        [m for o in opts.values() for m in o.master_params],
        used,
        norms,
        after,
        sc.get_scale(),
        sc.skipped_steps(),
    )


def assert_same(run: Run, ref: Run, schedule, *, every_iteration: bool = False) -> None:
    assert all(torch.equal(p, q) for p, q in zip(run.params, ref.params, strict=True))
    assert all(torch.equal(m, r) for m, r in zip(run.masters, ref.masters, strict=True))
    assert run.used == ref.used
    assert len(run.norms) == len(ref.norms)
    for n, r in zip(run.norms, ref.norms):
        torch.testing.assert_close(n, r, rtol=0, atol=0, equal_nan=True)  # bit for bit (an overflow's is inf/nan)
    full = {it for it in ref.after if every_iteration or len(schedule(it).order) == 2}
    assert {it: run.after[it] for it in full} == {it: ref.after[it] for it in full}
    assert (run.final, run.skipped) == (ref.final, ref.skipped)
    assert len(set(ref.used)) > 2  # the scale moved: an early update would have shown


# ---------------------------------------------------------------------- Lightning, manual optimization
class Manual(L.pytorch.LightningModule):
    def __init__(self, schedule) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net, self.schedule = make_net(), schedule
        self.used: list[float] = []
        self.norms: list[torch.Tensor] = []
        self.after: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        plugin, plan = self.trainer.precision_plugin, self.schedule(batch_idx)
        opts = dict(zip("ab", self.optimizers()))
        for opt in opts.values():
            opt.zero_grad()
        for loss in losses(self.net, x, y, plan):
            self.manual_backward(loss)
        self.used.append(plugin.scaler.get_scale())
        inject(self.net, plan)
        for name in plan.order:
            self.clip_gradients(opts[name], gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            self.norms.append(plugin.last_grad_norm)
            opts[name].step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after[batch_idx] = self.trainer.precision_plugin.scaler.get_scale()

    def configure_optimizers(self):
        return inners(self.net)


def lightning_trainer(plugin, **kw) -> L.pytorch.Trainer:
    opts = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.pytorch.Trainer(plugins=[plugin], **{**opts, **kw})


def loader(data) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=None)


def lightning_run(schedule, async_step: bool) -> Run:
    module, plugin = Manual(schedule), MasterWeightsPrecision(scaler=scaler(), async_step=async_step)
    lightning_trainer(plugin).fit(module, loader(batches()))
    return Run(
        list(module.net.parameters()),
        [m for o in plugin.optimizers for m in o.master_params],
        module.used,
        module.norms,
        module.after,
        plugin.scaler.get_scale(),
        plugin.scaler.skipped_steps(),
    )


@pytest.mark.parametrize("schedule,async_step", CASES)
def test_lightning_manual_optimization(schedule, async_step):
    assert_same(lightning_run(schedule, async_step), reference(schedule, async_step), schedule, every_iteration=True)


def test_lightning_epoch_end_checkpoint_resumes_bit_for_bit(tmp_path):
    """The last iteration of epoch 0 steps only a; ModelCheckpoint saves at the epoch's end:
    the checkpoint holds the updated scale, and a run resumed from it continues bit for bit."""
    data = batches(6)

    def run(root, ckpt=None):
        module, plugin = Manual(b_every_kth_first), MasterWeightsPrecision(scaler=scaler())
        cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        lightning_trainer(plugin, max_epochs=2, enable_checkpointing=True, callbacks=[cb], default_root_dir=root).fit(
            module, loader(data), ckpt_path=ckpt
        )
        return module, plugin

    whole, whole_plugin = run(tmp_path / "a")
    saved = torch.load(tmp_path / "a" / "epoch=0.ckpt", weights_only=True)["MasterWeightsPrecision"]["scaler"]
    assert saved["scale"] == whole.used[6] != whole.used[5]  # the scale epoch 1 begins with
    resumed, plugin = run(tmp_path / "b", tmp_path / "a" / "epoch=0.ckpt")
    assert resumed.used == whole.used[6:]
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), whole.parameters(), strict=True))
    for o, r in zip(plugin.optimizers, whole_plugin.optimizers, strict=True):
        assert all(torch.equal(m, n) for m, n in zip(o.master_params, r.master_params, strict=True))
    assert plugin.scaler.state_dict() == whole_plugin.scaler.state_dict()


# ---------------------------------------------------------------------- Fabric, Accelerate
class Loop:
    """The user's loop through an adapter (:meth:`backward`, :meth:`clip`, the optimizers'
    ``step``), recording what :class:`Run` compares."""

    def __init__(self, schedule, net: torch.nn.Module) -> None:
        self.schedule, self.net = schedule, net  # net: the layers (inject, clip) -- not the framework's wrapper
        self.used: list[float] = []
        self.norms: list[torch.Tensor] = []
        self.after: dict[int, float] = {}

    def train(self, its) -> None:
        data = batches()
        for it in its:
            x, y = data[it]
            plan = self.schedule(it)
            for opt in self.opts.values():
                opt.zero_grad()
            for loss in losses(self.model, x, y, plan):
                self.backward(loss)
            self.used.append(self.scaler.get_scale())
            inject(self.net, plan)
            for name in plan.order:
                self.norms.append(self.clip(name))
                self.opts[name].step()
            self.after[it] = self.scaler.get_scale()

    def run(self) -> Run:
        for opt in self.mixed_optimizers():
            opt.synchronize()
        self.settle_scale()
        return Run(
            list(self.net.parameters()),
            [m for o in self.mixed_optimizers() for m in o.master_params],
            self.used,
            self.norms,
            self.after,
            self.scaler.get_scale(),
            self.scaler.skipped_steps(),
        )


class FabricLoop(Loop):
    def __init__(self, schedule, async_step: bool = False, seed: int = 0) -> None:
        self.plugin = MasterWeightsFabricPrecision(scaler=scaler())
        self.fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[self.plugin])
        with self.fabric.init_module():
            net = make_net(seed)
        super().__init__(schedule, net)
        oa, ob = (fp16kit.MixedPrecisionOptimizer(i, async_step=async_step) for i in inners(net))
        self.model, oa, ob = self.fabric.setup(net, oa, ob)
        self.opts, self.scaler, self.settle_scale = {"a": oa, "b": ob}, self.plugin.scaler, self.plugin.settle_scale

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def clip(self, name: str) -> torch.Tensor:
        return self.fabric.clip_gradients(self.model, self.opts[name], max_norm=CLIP, error_if_nonfinite=False)

    def mixed_optimizers(self) -> list[fp16kit.MixedPrecisionOptimizer]:
        return list(self.opts.values())

    def save(self, path) -> None:
        self.fabric.save(path, self._state())  # the plugin's state_dict: the owed update first

    def load(self, path) -> None:
        self.fabric.load(path, self._state())

    def _state(self) -> dict:
        return {"model": self.model, "a": self.opts["a"], "b": self.opts["b"], "scaler": self.plugin}


class AccelerateLoop(Loop):
    def __init__(self, schedule, async_step: bool = False, seed: int = 0) -> None:
        from fp16kit.integrations.accelerate import MasterWeightsAccelerator

        reset_accelerate()
        self.acc = MasterWeightsAccelerator("fp16", cpu=True, async_step=async_step, scaler=scaler())
        net = make_net(seed)
        super().__init__(schedule, net)
        self.model, oa, ob = self.acc.prepare(net, *inners(net))
        self.opts, self.scaler, self.settle_scale = {"a": oa, "b": ob}, self.acc.scaler, self.acc.settle_scale

    def backward(self, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    def clip(self, name: str) -> torch.Tensor:
        return self.acc.clip_grad_norm_(self.net[{"a": 0, "b": 2}[name]].parameters(), CLIP)

    def mixed_optimizers(self) -> list[fp16kit.MixedPrecisionOptimizer]:
        return [o.optimizer for o in self.opts.values()]

    def save(self, path) -> None:
        self.acc.save_state(path)

    def load(self, path) -> None:
        self.acc.load_state(str(path))


@pytest.fixture(params=["fabric", "accelerate"])
def adapter(request):
    if request.param == "fabric":
        yield FabricLoop
        return
    pytest.importorskip(
        "accelerate", reason="the Accelerate adapter needs accelerate: pip install 'fp16kit[accelerate]'"
    )
    reset_accelerate()
    yield AccelerateLoop
    reset_accelerate()


@pytest.mark.parametrize("schedule,async_step", CASES)
def test_fabric_and_accelerate(adapter, schedule, async_step):
    loop = adapter(schedule, async_step)
    loop.train(range(ITERS))
    assert_same(loop.run(), reference(schedule, async_step), schedule)


SAVE_AT = 4  # after iterations 0-3: in iteration 3 only a stepped, b may still step on its grads


def test_checkpoint_while_an_update_is_owed_resumes_bit_for_bit(adapter, tmp_path):
    ref = reference(b_every_kth_first, False)
    saving = adapter(b_every_kth_first)
    saving.train(range(SAVE_AT))
    assert saving.scaler.get_scale() == ref.used[SAVE_AT - 1] != ref.after[SAVE_AT - 1]  # the update still owed
    saving.save(tmp_path / "ckpt")
    saving.train(range(SAVE_AT, ITERS))
    assert_same(saving.run(), ref, b_every_kth_first)  # saving changed nothing

    resumed = adapter(b_every_kth_first, seed=7)  # fresh objects: everything from the checkpoint
    resumed.load(tmp_path / "ckpt")
    assert resumed.scaler.get_scale() == ref.used[SAVE_AT]
    resumed.train(range(SAVE_AT, ITERS))
    run = resumed.run()
    assert run.used == ref.used[SAVE_AT:]
    assert all(torch.equal(p, q) for p, q in zip(run.params, ref.params, strict=True))
    assert all(torch.equal(m, r) for m, r in zip(run.masters, ref.masters, strict=True))
    assert run.final == ref.final
