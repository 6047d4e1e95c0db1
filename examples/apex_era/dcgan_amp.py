"""An apex.amp script in the style of apex's DCGAN example: two models, two optimizers, three
losses, `amp.initialize(..., num_losses=3)` and `amp.scale_loss(..., loss_id=...)`.

Unmodified apex code: `fp16kit run examples/apex_era/dcgan_amp.py --opt_level O1`.
"""

import argparse

import torch
import torch.nn as nn

from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--opt_level", default="O1")
parser.add_argument("--niter", type=int, default=20)
opt = parser.parse_args()

torch.manual_seed(999)
nz, nx = 8, 16
netG = nn.Sequential(nn.Linear(nz, 32), nn.ReLU(), nn.Linear(32, nx), nn.Tanh())
netD = nn.Sequential(nn.Linear(nx, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))

[netD, netG], [optimizerD, optimizerG] = amp.initialize(
    [netD, netG], [optimizerD, optimizerG], opt_level=opt.opt_level, num_losses=3, verbosity=0
)

real_source = torch.randn(512, nx).mul(0.3).add(0.5).tanh()
for i in range(opt.niter):
    real = real_source[(i * 32) % 480 : (i * 32) % 480 + 32]
    noise = torch.randn(32, nz)

    netD.zero_grad()
    errD_real = criterion(netD(real).float(), torch.ones(32, 1))
    with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
        errD_real_scaled.backward()
    fake = netG(noise)
    errD_fake = criterion(netD(fake.detach()).float(), torch.zeros(32, 1))
    with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
        errD_fake_scaled.backward()
    optimizerD.step()

    netG.zero_grad()
    errG = criterion(netD(fake).float(), torch.ones(32, 1))
    with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
        errG_scaled.backward()
    optimizerG.step()
    if i % 5 == 0:
        print(f"[{i}/{opt.niter}] Loss_D {(errD_real + errD_fake).item():.4f} Loss_G {errG.item():.4f}")

state = amp.state_dict()
print("loss scalers:", sorted(state))
print(f"final loss {errG.item():.4f}")
