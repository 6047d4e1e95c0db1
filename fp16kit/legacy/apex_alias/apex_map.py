"""The one table of apex (and Megatron-LM v1) import paths fp16kit covers.

Shared by ``fp16kit migrate`` (the codemod) and ``install_apex_alias()`` / ``fp16kit run`` (the
import hook).

Contract::

    resolve(path, megatron) ->
        None                          path is not under a name fp16kit handles (leave it alone)
        Resolution(target=T, rest=R)  path = <mapped module> + R; fp16kit's module is T, so the
                                      name becomes T + R (R == "": the path IS a module we map)
        Resolution(hint=H)            an apex name fp16kit does not cover; H names the replacement

    longest prefix wins:  for prefix in path, path[:-1], ..., root:
        prefix in UNCOVERED          -> hint
        prefix in the module table   -> target (a CLOSED package maps only the children listed,
                                        so anything else below it is uncovered)
        otherwise                    -> the generic hint

Nothing here imports fp16kit.legacy: targets are strings, resolved lazily by whoever needs them
(several of them are built by other parts of fp16kit and the table must not depend on their import
order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "APEX_MODULES",
    "ROOTS",
    "EXTENSION_ROOTS",
    "MEGATRON_MODULES",
    "CLOSED",
    "STAR_MODULES",
    "UNCOVERED",
    "Resolution",
    "module_map",
    "is_handled",
    "resolve",
    "hint_for",
]

_L = "fp16kit.legacy"


def _same_names(apex_pkg: str, fp16kit_pkg: str, subs: tuple[str, ...]) -> dict[str, str]:
    table = {apex_pkg: fp16kit_pkg}
    table.update({f"{apex_pkg}.{s}": f"{fp16kit_pkg}.{s}" for s in subs})
    return table


# apex module path -> fp16kit module path (the module objects are the same under the alias)
APEX_MODULES: Mapping[str, str] = MappingProxyType(
    {
        # `import apex` -> fp16kit.legacy for the codemod; a synthetic package under the alias
        "apex": _L,
        "apex.fp16_utils": _L,
        "apex.fp16_utils.fp16_optimizer": f"{_L}.fp16_optimizer",
        "apex.fp16_utils.fp16util": f"{_L}.fp16util",
        "apex.fp16_utils.loss_scaler": f"{_L}.loss_scaler",
        "apex.fp16_utils.fused_weight_norm": f"{_L}.fused_weight_norm",  # 2018
        **_same_names("apex.amp", f"{_L}.amp", ("_amp_state", "_process_optimizer", "frontend", "handle", "scaler")),
        # O1's op lists, which scripts edit before amp.initialize (NVIDIA's Tacotron2, WaveGlow)
        **_same_names(
            "apex.amp.lists", f"{_L}.amp.lists", ("functional_overrides", "torch_overrides", "tensor_overrides")
        ),
        **_same_names(
            "apex.optimizers",
            f"{_L}.optimizers",
            ("fused_adam", "fused_lamb", "fused_sgd", "fused_novograd", "fused_adagrad", "fp16_optimizer"),
        ),
        "apex.contrib": f"{_L}.contrib",
        **_same_names(
            "apex.contrib.optimizers", f"{_L}.contrib.optimizers", ("fp16_optimizer", "fused_adam", "fused_sgd")
        ),
        **_same_names(
            "apex.parallel",
            f"{_L}.parallel",
            ("distributed", "sync_batchnorm", "optimized_sync_batchnorm", "LARC", "multiproc"),
        ),
        **_same_names("apex.normalization", f"{_L}.normalization", ("fused_layer_norm",)),
        "apex.multi_tensor_apply": f"{_L}.multi_tensor_apply",
        # apex's CUDA extension module of multi-tensor ops: the two scripts call (multi_tensor_scale,
        # multi_tensor_l2norm) are module-level functions of fp16kit.legacy.multi_tensor_apply
        "amp_C": f"{_L}.multi_tensor_apply",
        "apex_C": f"{_L}.apex_c",
    }
)

# apex modules whose star import must bind fewer names than their target exports: fp16kit.legacy is
# apex.fp16_utils *and* the parent of apex's other packages, so `from apex.fp16_utils import *` into
# it would also bind amp, optimizers, parallel, load_checkpoint, ... over a script's own names. The
# codemod rewrites such a star import to the narrower module, and the alias makes it the module.
STAR_MODULES: Mapping[str, str] = MappingProxyType({"apex.fp16_utils": f"{_L}.fp16_utils"})

# top-level names the table speaks for without --megatron
ROOTS = frozenset({"apex", "amp_C", "apex_C"})

# Megatron-LM v1's copied fp16 package (repo-root `fp16`, later `megatron.fp16`); opt-in only
MEGATRON_MODULES: Mapping[str, str] = MappingProxyType(
    {
        **_same_names("fp16", f"{_L}.megatron", ("fp16", "fp16util", "loss_scaler")),
        **_same_names("megatron.fp16", f"{_L}.megatron", ("fp16", "fp16util", "loss_scaler")),
    }
)

# packages whose only attributes are the submodules listed above (apex/__init__.py and
# apex/contrib/__init__.py defined nothing else), so `apex.foo` is uncovered, not fp16kit.legacy.foo;
# under the alias they are synthetic packages holding just those submodules
CLOSED = frozenset({"apex", "apex.contrib"})

_TORCH_COMPILE = "torch.compile fuses the pointwise parts"
_ZERO = "torch.distributed.optim.ZeroRedundancyOptimizer, or FSDP (torch.distributed.fsdp.fully_shard) with torch.optim.AdamW"

# apex names fp16kit does not provide -> the closest replacement (longest prefix wins)
UNCOVERED: Mapping[str, str] = MappingProxyType(
    {
        "apex.RNN": "apex.RNN (LSTM, GRU, ReLU, Tanh, mLSTM) is not in fp16kit: use torch.nn.LSTM / torch.nn.GRU / "
        "torch.nn.RNN(nonlinearity='relu'|'tanh'); there is no mLSTM",
        "apex.reparameterization": "apex.reparameterization is not in fp16kit: use "
        "torch.nn.utils.parametrizations.weight_norm (apply_weight_norm) and "
        "torch.nn.utils.parametrize.remove_parametrizations (remove_weight_norm)",
        "apex.transformer": "apex.transformer (tensor/pipeline model parallelism) is not in fp16kit: use Megatron-Core "
        "(megatron.core) or torch.distributed.tensor.parallel",
        "apex.mlp": "apex.mlp.MLP is not in fp16kit: use torch.nn.Sequential of nn.Linear and activations; "
        + _TORCH_COMPILE,
        "apex.fused_dense": "apex.fused_dense is not in fp16kit: use torch.nn.Linear (+ torch.nn.functional.gelu); "
        + _TORCH_COMPILE,
        "apex.amp.amp": "apex.amp.amp is internal: use fp16kit.legacy.amp (init, half_function, float_function, ...)",
        "apex.amp.opt": "apex.amp.opt (2018 optimizer wrapper) is internal: use fp16kit.legacy.amp.init()'s handle",
        "apex.amp.wrap": "apex.amp.wrap is internal: use fp16kit.legacy.amp's half_function / float_function",
        "apex.amp.utils": "apex.amp.utils is internal: cast with tensor.half() / .float(), or torch.autocast",
        "apex.amp._initialize": "apex.amp._initialize is internal: use fp16kit.legacy.amp.initialize",
        "apex.amp.compat": "apex.amp.compat is internal (torch-version shims): not needed on modern torch",
        "apex.amp.rnn_compat": "apex.amp.rnn_compat is internal: not needed on modern torch",
        "apex.optimizers.FusedMixedPrecisionLamb": "FusedMixedPrecisionLamb is not in fp16kit: use "
        "fp16kit.legacy.optimizers.FusedLAMB inside fp16kit.MixedPrecisionOptimizer (fp32 master weights)",
        "apex.optimizers.fused_mixed_precision_lamb": "FusedMixedPrecisionLamb is not in fp16kit: use "
        "fp16kit.legacy.optimizers.FusedLAMB inside fp16kit.MixedPrecisionOptimizer (fp32 master weights)",
        "apex.contrib.optimizers.FusedLAMB": "apex.contrib's FusedLAMB is not in fp16kit: use "
        "fp16kit.legacy.optimizers.FusedLAMB (apex.optimizers.FusedLAMB's API)",
        "apex.contrib.optimizers.fused_lamb": "apex.contrib's FusedLAMB is not in fp16kit: use "
        "fp16kit.legacy.optimizers.FusedLAMB (apex.optimizers.FusedLAMB's API)",
        "apex.contrib.optimizers.DistributedFusedAdam": "DistributedFusedAdam is not in fp16kit: use " + _ZERO,
        "apex.contrib.optimizers.DistributedFusedLAMB": "DistributedFusedLAMB is not in fp16kit: use " + _ZERO,
        "apex.contrib.optimizers.distributed_fused_adam": "DistributedFusedAdam is not in fp16kit: use " + _ZERO,
        "apex.contrib.optimizers.distributed_fused_lamb": "DistributedFusedLAMB is not in fp16kit: use " + _ZERO,
        "apex.contrib.xentropy": "apex.contrib.xentropy is not in fp16kit: use "
        "torch.nn.functional.cross_entropy(logits, target, label_smoothing=...)",
        "apex.contrib.multihead_attn": "apex.contrib.multihead_attn is not in fp16kit: use torch.nn.MultiheadAttention "
        "or torch.nn.functional.scaled_dot_product_attention",
        "apex.contrib.fmha": "apex.contrib.fmha is not in fp16kit: use torch.nn.functional.scaled_dot_product_attention",
        "apex.contrib.layer_norm": "apex.contrib.layer_norm (FastLayerNorm) is not in fp16kit: use torch.nn.LayerNorm "
        "or fp16kit.legacy.normalization.FusedLayerNorm",
        "apex.contrib.group_norm": "apex.contrib.group_norm is not in fp16kit: use torch.nn.GroupNorm",
        "apex.contrib.groupbn": "apex.contrib.groupbn is not in fp16kit: use torch.nn.BatchNorm2d or torch.nn.SyncBatchNorm",
        "apex.contrib.cudnn_gbn": "apex.contrib.cudnn_gbn is not in fp16kit: use torch.nn.SyncBatchNorm with a process group",
        "apex.contrib.sparsity": "apex.contrib.sparsity (ASP) is not in fp16kit: use torch.ao.pruning, or "
        "torch.sparse.to_sparse_semi_structured for 2:4 sparsity",
        "apex.contrib.focal_loss": "apex.contrib.focal_loss is not in fp16kit: use torchvision.ops.sigmoid_focal_loss",
        "apex.contrib.clip_grad": "apex.contrib.clip_grad is not in fp16kit: use torch.nn.utils.clip_grad_norm_(..., foreach=True)",
        "apex.contrib.bottleneck": "apex.contrib.bottleneck is not in fp16kit: use torchvision.models.resnet.Bottleneck",
        "apex.contrib.conv_bias_relu": "apex.contrib.conv_bias_relu is not in fp16kit: use torch.nn.Conv2d then "
        "torch.nn.functional.relu; " + _TORCH_COMPILE,
        "apex.contrib.transducer": "apex.contrib.transducer is not in fp16kit: use torchaudio.functional.rnnt_loss",
        "apex.contrib.index_mul_2d": "apex.contrib.index_mul_2d is not in fp16kit: use plain indexing, in1[idx] * in2",
        "apex.contrib.peer_memory": "apex.contrib.peer_memory is not in fp16kit: use torch.distributed (isend/irecv, all_gather)",
        "apex.contrib.nccl_p2p": "apex.contrib.nccl_p2p is not in fp16kit: use torch.distributed (isend/irecv, batch_isend_irecv)",
        # apex's CUDA extensions: top-level modules of their own (the codemod reports them; the alias leaves them alone)
        # (amp_C and apex_C are covered: the module table above)
        **{
            ext: f"{ext} (apex's CUDA extension) is not in fp16kit: use {fix}"
            for ext, fix in {
                "fused_adam_cuda": "fp16kit.legacy.optimizers.FusedAdam",
                "fused_lamb_cuda": "fp16kit.legacy.optimizers.FusedLAMB",
                "fused_layer_norm_cuda": "torch.nn.functional.layer_norm (or fp16kit.legacy.normalization.FusedLayerNorm)",
                "fast_layer_norm": "torch.nn.functional.layer_norm",
                "syncbn": "torch.nn.SyncBatchNorm",
                "xentropy_cuda": "torch.nn.functional.cross_entropy(logits, target, label_smoothing=...)",
                "mlp_cuda": "torch.nn.Linear layers; " + _TORCH_COMPILE,
                "fused_dense_cuda": "torch.nn.functional.linear (+ torch.nn.functional.gelu); " + _TORCH_COMPILE,
                "fused_weight_gradient_mlp_cuda": "torch.matmul into the main grad (Megatron: --no-gradient-accumulation-fusion)",
                "fmhalib": "torch.nn.functional.scaled_dot_product_attention",
                "fast_multihead_attn": "torch.nn.MultiheadAttention or torch.nn.functional.scaled_dot_product_attention",
                "focal_loss_cuda": "torchvision.ops.sigmoid_focal_loss",
                "distributed_adam_cuda": _ZERO,
                "distributed_lamb_cuda": _ZERO,
                "transducer_joint_cuda": "torchaudio.functional.rnnt_loss",
                "transducer_loss_cuda": "torchaudio.functional.rnnt_loss",
                "fused_index_mul_2d": "plain indexing, in1[idx] * in2",
                "peer_memory_cuda": "torch.distributed (isend/irecv, all_gather)",
                "nccl_p2p_cuda": "torch.distributed (isend/irecv, batch_isend_irecv)",
                "cudnn_gbn_lib": "torch.nn.SyncBatchNorm with a process group",
                "fused_conv_bias_relu": "torch.nn.Conv2d then torch.nn.functional.relu; " + _TORCH_COMPILE,
            }.items()
        },
    }
)
EXTENSION_ROOTS = frozenset(k for k in UNCOVERED if "." not in k)


@dataclass(frozen=True)
class Resolution:
    """Where an apex path goes: ``target`` + ``rest`` (covered) or ``hint`` (not covered)."""

    path: str
    target: str | None = None  # fp16kit module of the longest mapped prefix
    rest: str = ""  # the part of ``path`` below that prefix, with its leading dot ("" = a module)
    prefix: str = ""  # the mapped prefix of ``path``
    hint: str | None = None

    @property
    def covered(self) -> bool:
        return self.target is not None

    @property
    def new_path(self) -> str:
        assert self.target is not None, self.path
        return self.target + self.rest


def module_map(*, megatron: bool = False) -> Mapping[str, str]:
    """The apex (and, with ``megatron=True``, Megatron ``fp16``) module -> fp16kit module table."""
    if not megatron:
        return APEX_MODULES
    return MappingProxyType({**APEX_MODULES, **MEGATRON_MODULES})


def is_handled(path: str, *, megatron: bool = False, extensions: bool = False) -> bool:
    """Whether ``path`` is under a name this table speaks for.

    ``apex``, ``amp_C``; ``fp16`` and ``megatron.fp16`` with ``megatron``; apex's other CUDA
    extension modules with ``extensions``."""
    root = path.partition(".")[0]
    if root in ROOTS or (extensions and root in EXTENSION_ROOTS):
        return True
    if megatron:
        return root == "fp16" or path == "megatron.fp16" or path.startswith("megatron.fp16.")
    return False


def _generic_hint(path: str, megatron: bool) -> str:
    root = path.partition(".")[0]
    if root in ("fp16", "megatron"):
        covered = ", ".join(sorted(k for k in MEGATRON_MODULES if k.partition(".")[0] == root))
        return f"{path} is not covered by fp16kit: fp16kit.legacy.megatron provides {covered}"
    tops = sorted({k for k in APEX_MODULES if k.count(".") == 1 and k != "apex.contrib"} | {"apex.contrib.optimizers"})
    return f"{path} is not covered by fp16kit: fp16kit.legacy provides {', '.join(tops)} (see MIGRATION.md)"


def resolve(path: str, *, megatron: bool = False) -> Resolution | None:
    """Map a dotted apex path (module, or module + attributes); None when it is not ours."""
    if not is_handled(path, megatron=megatron, extensions=True):
        return None
    table = module_map(megatron=megatron)
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in UNCOVERED:
            return Resolution(path, prefix=prefix, hint=UNCOVERED[prefix])
        if prefix in table:
            if n < len(parts) and prefix in CLOSED:
                below = ".".join(parts[: n + 1])
                return Resolution(path, prefix=below, hint=_generic_hint(below, megatron))
            rest = path[len(prefix) :]
            return Resolution(path, target=table[prefix], rest=rest, prefix=prefix)
    return Resolution(path, prefix=path, hint=_generic_hint(path, megatron))


def hint_for(path: str, *, megatron: bool = False) -> str:
    """What to use instead of an apex path fp16kit does not provide (or where it lives if it does)."""
    res = resolve(path, megatron=megatron)
    if res is None:
        return f"{path} is not an apex module"
    if res.hint is not None:
        return res.hint
    if res.rest:
        return f"{path} is not covered by fp16kit ({res.prefix} is {res.target}; see MIGRATION.md)"
    return f"{path} is {res.new_path} in fp16kit"
