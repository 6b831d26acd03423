"""clipjax: global-norm gradient clipping for JAX, fused on the GPU.

`andrea_clip(max_norm)` is an optax GradientTransformation; on NVIDIA GPUs it
runs three CUDA kernels in one XLA FFI custom call, elsewhere a pure-JAX twin.
"""

from clipjax._andrea_clip import andrea_clip
from clipjax._clip_state import AndreaClipState, clip_state, named_leaf_norms
from clipjax._clip_tree import clip_tree, clip_tree_in_shard_map, global_norm, sharded_clip_tree
from clipjax._native import platforms as ffi_platforms
from clipjax._skip import SkipSpikesState, skip_spikes
from clipjax._spike import ZScoreSpike
from clipjax._tree import ClipResult
from clipjax._version import __version__  # noqa: F401  (the package's version)

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
