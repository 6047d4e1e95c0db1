"""The memory-bandwidth bound, measured in the run: a large ``copy_`` timed in the same rounds as the variants.

The bounds are stated in bytes per parameter: the least memory traffic a step can
have, each byte read or written once::

    master-grad path   6 B/param = read the 16-bit grad (2) + write the fp32 master grad (4)
    master AdamW step 28 B/param = read the 16-bit grad (2), master, exp_avg, exp_avg_sq (3 x 4)
                                   + write master, exp_avg, exp_avg_sq (3 x 4), the 16-bit param (2)

Their time comes from :class:`Memcpy`, a ``dst.copy_(src)`` of two fp32 buffers far larger than
the last-level cache, run as one more variant of the interleaved rounds (so it sees the same
machine state as the variants it bounds). A copy of ``n`` bytes moves ``2 n`` (read + write);
per round::

    bandwidth  = 2 * n / t_copy                       # bytes per second this round
    t_bound    = bytes_per_param * params / bandwidth # the bound's time for this row, this round

and the figure is ``t_variant / t_bound`` round by round. Write-allocate traffic (a CPU reading a
cache line before overwriting it) is not counted on either side: the bound is the copy's own
rate, so a variant that moves its bytes as fast as ``copy_`` does stands at 1.0x.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .timing import Clock

__all__ = ["MASTER_GRAD_BYTES", "MASTER_STEP_BYTES", "Memcpy", "bound_times"]

MASTER_GRAD_BYTES = 6
"""Bytes per param the master-grad path must move (read 2, write 4)."""

MASTER_STEP_BYTES = 28
"""Bytes per param a fused fp16-model master-AdamW step must move."""


class Memcpy:
    """``dst.copy_(src)`` of two ``nbytes`` fp32 buffers on ``device``: the bandwidth probe."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        numel = max(1, nbytes // 4)
        self.src = torch.ones(numel, dtype=torch.float32, device=self.device)
        self.dst = torch.zeros_like(self.src)
        self.nbytes = numel * 4

    @property
    def moved(self) -> int:
        """The bytes one copy moves (read + write)."""
        return 2 * self.nbytes

    def run(self, n: int) -> float:
        clock = Clock(self.device)
        for _ in range(n):
            with clock:
                self.dst.copy_(self.src)
        return clock.seconds()

    def bandwidth(self, seconds_per_copy: float) -> float:
        """Bytes per second, from the time of one copy."""
        return self.moved / seconds_per_copy


def bound_times(copy_times: Sequence[float], moved: int, bytes_per_param: float, params: int) -> list[float]:
    """The bound's seconds per iteration in each round: ``bytes_per_param * params`` at that round's copy rate.

    ``copy_times`` are the seconds of one copy moving ``moved`` bytes, per round."""
    return [bytes_per_param * params * t / moved for t in copy_times]
