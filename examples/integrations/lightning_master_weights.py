"""Lightning with an fp16 model and fp32 master weights: fp16kit's MasterWeightsPrecision.

The model trains in fp16 (``"16-true"``, as Lightning's HalfPrecision keeps it); the optimizer
from ``configure_optimizers`` steps fp32 masters behind fp16kit.GradScaler. ``gradient_clip_val``
clips the masters; fp16kit's ``grad_norm`` logs the unscaled norm. The scaler starts at 2**20, so
the first steps overflow and are skipped while the scale calibrates. ``--async`` runs each
optimizer step on fp16kit's optimizer thread beside the next forward/backward.

    python examples/integrations/lightning_master_weights.py     # CPU, a few seconds
"""

import argparse
import logging

import lightning.pytorch as L
import torch

import fp16kit
from fp16kit.integrations.lightning import MasterWeightsPrecision, grad_norm


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch  # already fp16: the plugin converts the inputs
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # the unscaled norm of the master grads (Lightning's grad_norm would read the fp16
        # model grads, still multiplied by the loss scale here)
        self.grad_norms.append(float(grad_norm(self, 2)["grad_2.0_norm_total"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)  # the plugin wraps it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--async", dest="async_step", action="store_true")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    torch.manual_seed(0)
    teacher = torch.randn(16, 4)
    x = torch.randn(512, 16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x @ teacher)), batch_size=32)

    plugin = MasterWeightsPrecision(
        "16-true", scaler=fp16kit.GradScaler("cpu", init_scale=2.0**20), async_step=args.async_step
    )
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=args.epochs, plugins=[plugin], gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model, train_dataloaders=data)

    per_epoch = len(data)
    for epoch in range(args.epochs):
        epoch_losses = model.losses[epoch * per_epoch:(epoch + 1) * per_epoch]
        print(f"epoch {epoch}: loss {sum(epoch_losses) / len(epoch_losses):.4f}")
    opt = plugin.optimizers[0]
    print(f"model dtype {next(model.parameters()).dtype}, masters dtype {opt.master_params[0].dtype}")
    print(f"skipped steps {plugin.scaler.skipped_steps()}, final scale {plugin.scaler.get_scale():.0f}")
    print(f"last unscaled grad norm {model.grad_norms[-1]:.4f} (gradient_clip_val=1.0 clips the masters)")


if __name__ == "__main__":
    main()
