"""Lightning: ``MasterWeightsPrecision`` (fp32 masters behind a Lightning precision plugin).

See :mod:`.plugin` for the hooks; :mod:`.fabric` for Fabric; the other modules are its parts.
"""

from .plugin import MasterWeightsPrecision, grad_norm

__all__ = ["MasterWeightsPrecision", "grad_norm"]
