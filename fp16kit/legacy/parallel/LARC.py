"""apex.parallel.LARC: ``LARC(optimizer, trust_coefficient=0.02, clip=True, eps=1e-8)``.

The wrapper of :mod:`fp16kit.optim.larc` (apex's arithmetic, bit for bit)."""

from ...optim.larc import LARC

__all__ = ["LARC"]
