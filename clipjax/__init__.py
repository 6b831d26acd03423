"""clipjax: global-norm gradient clipping for JAX, fused on the GPU.

`andrea_clip(max_norm)` is an optax GradientTransformation; on NVIDIA GPUs it
runs three CUDA kernels in one XLA FFI custom call, elsewhere a pure-JAX twin.
"""

from clipjax._clip import (AndreaClipState, andrea_clip, clip_state, clip_tree, global_norm,
                           named_leaf_norms)
from clipjax._native import platforms as ffi_platforms
from clipjax._version import __version__  # noqa: F401  (the package's version)
from clipjax._options import ClipResult
from clipjax._sharded import clip_tree_in_shard_map, sharded_clip_tree
from clipjax._skip import SkipSpikesState, skip_spikes
from clipjax._spike import ZScoreSpike

__all__ = [
    "AndreaClipState",
    "ClipResult",
    "SkipSpikesState",
    "ZScoreSpike",
    "andrea_clip",
    "clip_state",
    "clip_tree",
    "clip_tree_in_shard_map",
    "ffi_platforms",
    "global_norm",
    "named_leaf_norms",
    "sharded_clip_tree",
    "skip_spikes",
]
