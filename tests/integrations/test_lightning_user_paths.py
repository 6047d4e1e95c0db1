"""MasterWeightsPrecision on the paths a user's Lightning script takes (callbacks from the docs,
fine-tuning schedules, Ctrl-C, end-of-training weight swaps), against the plain fp16kit loop
written out here (model.half(), MixedPrecisionOptimizer, fp16kit.GradScaler, torch's
clip_grad_norm_ on the masters): bit for bit (torch.equal), Lightning adds no arithmetic.
"""

from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("lightning", reason="the Lightning adapter needs lightning: pip install 'fp16kit[lightning]'")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.lightning import MasterWeightsPrecision  # noqa: E402

LR, CLIP, N_BATCHES = 0.05, 0.5, 4


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(n: int = N_BATCHES, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def loader(data) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=None)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y.float()).pow(2).mean()


def trainer(plugin, **kw) -> L.Trainer:
    opts = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    opts.update(kw)
    return L.Trainer(plugins=[plugin], **opts)


def same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


# ---------------------------------------------------------------------- fine-tuning schedules
class Backbone(L.LightningModule):
    """Lightning's BackboneFinetuning recipe: ``self.backbone`` frozen, the optimizer over the
    trainable params only; the callback unfreezes the backbone and adds it as a param group."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.backbone = self.net[0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_of(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=LR, momentum=0.9)


def finetuning() -> BackboneFinetuning:
    # at epoch 1 the backbone joins with lr LR * 0.1; lambda_func 1.0 keeps it there
    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0)


def finetuning_reference(epochs: int):
    net = make_net().half()
    for p in net[0].parameters():
        p.requires_grad_(False)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR,
                                                           momentum=0.9))
    scaler = fp16kit.GradScaler("cpu")
    for epoch in range(epochs):
        if epoch == 1:
            for p in net[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(net[0].parameters()), "lr": LR * 0.1})
        for x, y in batches():
            opt.zero_grad()
            scaler.scale(loss_of(net(x.half()), y.half())).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.master_params, CLIP)
            scaler.step(opt)
            scaler.update()
    return net, opt


def test_backbone_finetuning_unfreezes_into_the_masters():
    # was: KeyError(<master tensor>) in BaseFinetuning._store (it names the param groups' params
    # through pl_module.named_parameters(); the groups hold the fp32 masters)
    model, plugin = Backbone(), MasterWeightsPrecision()
    trainer(plugin, max_epochs=3, callbacks=[finetuning()], gradient_clip_val=CLIP).fit(
        model, train_dataloaders=loader(batches()))
    ref, ref_opt = finetuning_reference(3)
    assert same(model.net.parameters(), ref.parameters())
    (opt,) = plugin.optimizers
    assert [g["lr"] for g in opt.param_groups] == [LR, LR * 0.1]
    assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
    assert same(opt.master_params, ref_opt.master_params)


def test_backbone_finetuning_resumes_bit_for_bit(tmp_path):
    # on resume BaseFinetuning.on_fit_start re-creates the added groups by name: they must
    # get masters (assigning model params to the groups would step the fp16 params directly)
    def run(root, ckpt=None):
        model, plugin = Backbone(), MasterWeightsPrecision()
        cb = L.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        trainer(plugin, max_epochs=3, callbacks=[finetuning(), cb], enable_checkpointing=True,
                gradient_clip_val=CLIP).fit(model, train_dataloaders=loader(batches()), ckpt_path=ckpt)
        return model, plugin

    a_model, a_plugin = run(tmp_path / "a")
    b_model, b_plugin = run(tmp_path / "b", tmp_path / "a" / "epoch=1.ckpt")  # after the unfreeze
    assert same(a_model.parameters(), b_model.parameters())
    (a_opt,), (b_opt,) = a_plugin.optimizers, b_plugin.optimizers
    assert same(a_opt.master_params, b_opt.master_params)
    assert all(m.dtype == torch.float32 for g in b_opt.param_groups for m in g["params"])


# ---------------------------------------------------------------------- the end of training
class Swap(L.Callback):
    """An EMA-style callback: at the end of training it loads other weights into the model."""

    def on_train_end(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.fill_(0.25)


@pytest.mark.parametrize("async_step", [False, True])
def test_a_callback_swapping_weights_at_train_end_is_not_overwritten(async_step):
    # was (async): the landing callback ran after the user's on_train_end and copied the
    # masters over the swapped-in weights (StochasticWeightAveraging's average was lost)
    model, plugin = Backbone(), MasterWeightsPrecision(async_step=async_step)
    trainer(plugin, callbacks=[Swap()]).fit(model, train_dataloaders=loader(batches()))
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model.parameters())
    (opt,) = plugin.optimizers  # the step in flight landed before the swap: nothing pending
    opt.synchronize()
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model.parameters())


def test_stochastic_weight_averaging_leaves_the_average_async():
    model, plugin = Backbone(), MasterWeightsPrecision(async_step=True)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    trainer(plugin, max_epochs=3, callbacks=[swa]).fit(model, train_dataloaders=loader(batches()))
    # the model holds SWA's average (kept in fp32: SWA copies the module at setup, before the
    # plugin casts it), not the masters of the last step
    assert same(model.parameters(), (p.half() for p in swa._average_model.parameters()))
    (opt,) = plugin.optimizers
    assert not same(model.parameters(), (m.half() for m in opt.master_params))


# ---------------------------------------------------------------------- fitting again
class Cached(Backbone):
    """Builds its optimizer once (``setup``) and returns it from every ``configure_optimizers``:
    ``trainer.fit`` again continues with its state."""

    def setup(self, stage):
        if not hasattr(self, "opt"):
            self.opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def configure_optimizers(self):
        return self.opt


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_fit_again_with_the_same_optimizer_continues(precision):
    # was: the optimizer, whose groups already held the masters, was wrapped a second time, in
    # a wrapper without masters: fp16 raised "No inf checks were recorded for this optimizer",
    # bf16 trained nothing more, silently
    dtype = torch.float16 if precision == "16-true" else torch.bfloat16
    model, plugin = Cached(), MasterWeightsPrecision(precision)
    t = trainer(plugin)
    t.fit(model, train_dataloaders=loader(batches()))
    (first,) = plugin.optimizers
    t.fit_loop.max_epochs = 2
    t.fit(model, train_dataloaders=loader(batches()))  # the same Trainer, one more epoch
    other = MasterWeightsPrecision(precision)
    trainer(other).fit(model, train_dataloaders=loader(batches()))  # a new Trainer, one more
    assert plugin.optimizers == other.optimizers == [first]

    net = make_net().to(dtype)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    scaler = fp16kit.GradScaler("cpu") if precision == "16-true" else None
    for _ in range(3):
        for x, y in batches():
            opt.zero_grad()
            loss = loss_of(net(x.to(dtype)), y.to(dtype))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    assert same(model.net.parameters(), net.parameters())
    assert same(first.master_params, opt.master_params)


def test_fit_again_with_other_master_options_is_refused():
    model = Cached()
    trainer(MasterWeightsPrecision()).fit(model, train_dataloaders=loader(batches()))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="same options"):
        trainer(MasterWeightsPrecision(async_step=True)).fit(model, train_dataloaders=loader(batches()))
    assert same(model.parameters(), before)
