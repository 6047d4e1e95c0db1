"""apex's ImageNet example on two gloo ranks (127.0.0.1): convert_syncbn_model -> amp.initialize
(O1 and O2, static scale) -> apex DDP(delay_allreduce=True), three SGD steps on per-rank batches,
against one float64 process training plain BatchNorm on the concatenated batch (hand-written
here with torch's own classes). Both ranks must agree bit for bit; the reference within fp16's
rounding. The checkpoint's ``module.`` keys load into the unwrapped model and back."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from _helpers.gloo import run_two_ranks

_WORKER = textwrap.dedent(
    """
    import sys, warnings, torch, torch.distributed as dist
    from fp16kit.legacy import amp
    from fp16kit.legacy.amp import casts
    from fp16kit.legacy.parallel import DistributedDataParallel as DDP, convert_syncbn_model

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(16, 2))

    def data(seed, *shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    def main(rank, world, init_file, out_file):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        res = {}
        for level in ("O2", "O1"):
            model = convert_syncbn_model(net())
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
            model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
            model = DDP(model, delay_allreduce=True)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for step in range(3):
                    n = 3 if rank == 0 else 5
                    x, y = data(10 * step + rank, n, 3, 4, 4), data(100 + 10 * step + rank, n, 2)
                    loss = (model(x).float() - y).pow(2).sum() / 4  # x2 ranks / 8: DDP averages
                    opt.zero_grad()
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                    opt.step()
            res[level] = {
                "bn": type(model.module[1]).__name__,
                "params": [p.detach().clone() for p in model.module.parameters()],
                "state_dict": model.state_dict(),
                "deprecations": [str(w.message) for w in seen
                                 if issubclass(w.category, (FutureWarning, DeprecationWarning))],
            }
            casts._disable_o1_for_tests()
        torch.save(res, f"{out_file}.{rank}")
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 2)
    )


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference():
    """float64 BatchNorm over both ranks' batches (3 + 5), loss = mean over the 8 samples."""
    model = _net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for step in range(3):
        x = torch.cat([_data(10 * step + r, n, 3, 4, 4) for r, n in ((0, 3), (1, 5))]).double()
        y = torch.cat([_data(100 + 10 * step + r, n, 2) for r, n in ((0, 3), (1, 5))]).double()
        opt.zero_grad()
        ((model(x) - y).pow(2).sum() / 8).backward()
        opt.step()
    return model


@pytest.mark.slow
def test_syncbn_amp_ddp_on_two_ranks_is_batchnorm_on_the_whole_batch(tmp_path):
    res = run_two_ranks(_WORKER, tmp_path)
    ref = _reference()
    for level in ("O2", "O1"):
        assert res[0][level]["bn"] == "SyncBatchNorm"
        # no deprecation warnings from the training loop (torch.distributed.nn's all_reduce warned)
        assert res[0][level]["deprecations"] == [] and res[1][level]["deprecations"] == []
        for a, b in zip(res[0][level]["params"], res[1][level]["params"]):
            assert torch.equal(a, b), level
        for (name, a), b in zip(ref.named_parameters(), res[0][level]["params"]):
            torch.testing.assert_close(
                b.double(),
                a.detach(),
                rtol=0,
                atol=2e-3,  # fp16 convs at both levels
                msg=lambda m: f"{level} {name}: {m}",
            )
        # the checkpoint: module.-prefixed keys load into the unwrapped model (after stripping) and back
        saved = dict(res[0][level]["state_dict"])
        assert all(k.startswith("module.") for k in saved)
        plain = _net()
        consume_prefix_in_state_dict_if_present(saved, "module.")
        plain.load_state_dict(saved)
        for name in ("1.running_mean", "1.running_var"):
            torch.testing.assert_close(plain.state_dict()[name].double(), ref.state_dict()[name], rtol=0, atol=1e-4)
        assert plain.state_dict()["1.num_batches_tracked"].item() == 3
        back = torch.nn.Module()
        back.module = _net()
        back.load_state_dict({f"module.{k}": v for k, v in plain.state_dict().items()})
