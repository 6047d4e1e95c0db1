"""fp16kit.distributed: apex.parallel's gradient arithmetic on torch.distributed, any backend.

- :func:`apex_allreduce_hook` / :class:`ApexAllreduceState`: a DDP communication hook that sums
  then scales as apex's DistributedDataParallel did (fp32 reduction, predivide factor, sum-only);
- :func:`broadcast_coalesced`, :func:`all_reduce_mean_coalesced`: apex's flattened collectives
  over lists of tensors (what ``apex.parallel.Reducer`` did); :func:`call_coalesced`, apex's
  ``flat_dist_call`` with any collective.
"""

from .coalesced import all_reduce_mean_coalesced, broadcast_coalesced, call_coalesced
from .comm_hooks import ApexAllreduceState, apex_allreduce_hook

__all__ = [
    "ApexAllreduceState",
    "all_reduce_mean_coalesced",
    "apex_allreduce_hook",
    "broadcast_coalesced",
    "call_coalesced",
]
