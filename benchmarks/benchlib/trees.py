"""Gradient trees shaped like the ANDREA GPT models, their random values, their float64
references, and their layouts over a 1-D device mesh."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

F32 = jnp.float32
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
AXIS = "data"
MAX_ROTATION = 8


@dataclasses.dataclass(frozen=True)
class GPT:
  vocab: int
  d: int
  layers: int
  ctx: int
  ff: int = 4


MODELS = {
    "gpt120m": GPT(vocab=8449, d=768, layers=12, ctx=1024),
    "gpt12m": GPT(vocab=8449, d=384, layers=6, ctx=1024),
    "tiny": GPT(vocab=97, d=32, layers=2, ctx=16),  # the --quick runs
    "probe": GPT(vocab=97, d=32, layers=12, ctx=16),  # gpt120m's 197 leaves, tiny
}
EXPECTED_COUNTS = {"gpt120m": (98_820_096, 197), "gpt12m": (17_529_600, 101)}


def gpt_grad_spec(model: str, dtype: str) -> dict:
  """ShapeDtypeStructs of a GPT's parameters: separate q/k/v/o with biases, a 4x MLP with
  biases, two layernorms per layer and a final one, token and position embeddings, an
  untied LM head."""
  m, dt = MODELS[model], DTYPES[dtype]

  def a(*shape):
    return jax.ShapeDtypeStruct(shape, dt)

  def dense(n_in, n_out):
    return {"kernel": a(n_in, n_out), "bias": a(n_out)}

  def layernorm():
    return {"scale": a(m.d), "bias": a(m.d)}

  spec = {"wte": a(m.vocab, m.d), "wpe": a(m.ctx, m.d)}
  for i in range(m.layers):
    spec[f"block_{i:02d}"] = {
        "ln1": layernorm(), "q": dense(m.d, m.d), "k": dense(m.d, m.d),
        "v": dense(m.d, m.d), "o": dense(m.d, m.d), "ln2": layernorm(),
        "mlp_in": dense(m.d, m.ff * m.d), "mlp_out": dense(m.ff * m.d, m.d)}
  spec["ln_f"] = layernorm()
  spec["lm_head"] = {"kernel": a(m.d, m.vocab)}
  return spec


def counts_note(model, params, leaves):
  """" (as expected)" when the counts match the model's published ones, else what was
  expected; "" for shapes with no published counts."""
  expected = EXPECTED_COUNTS.get(model)
  if expected is None:
    return ""
  return " (as expected)" if expected == (params, leaves) else f" (EXPECTED {expected})"


def random_tree_maker(spec, shardings=None):
  """jit(key, scale) -> a tree shaped as `spec` of standard normals times `scale`, placed as
  `shardings` says (a tree of shardings, or None: the default device).

  One random vector cut into the leaves: one random-number op to compile, where one op per
  leaf (197 of them for gpt120m) would take XLA minutes.
  """
  leaves, treedef = jax.tree.flatten(spec)
  sizes = [math.prod(x.shape) for x in leaves]
  offsets = np.cumsum([0] + sizes)

  def make(key, scale):
    flat = scale * jax.random.normal(key, (int(offsets[-1]),), F32)
    return treedef.unflatten([flat[int(o):int(o) + n].reshape(x.shape).astype(x.dtype)
                              for o, n, x in zip(offsets, sizes, leaves)])
  return jax.jit(make) if shardings is None else jax.jit(make, out_shardings=shardings)


@functools.lru_cache(maxsize=None)
def _default_maker(model, dtype):
  return random_tree_maker(gpt_grad_spec(model, dtype))


@dataclasses.dataclass(frozen=True)
class Case:
  """One model at one dtype on one device: its tree's size, and how many copies of it to
  rotate among so that at least `rotate_bytes` are touched before a copy is read again (a
  tree that fits in L2 is then still read from HBM)."""
  model: str
  dtype: str
  params: int
  leaves: int
  grad_bytes: int
  rotation: int

  @classmethod
  def make(cls, model, dtype, rotate_bytes):
    leaves = jax.tree.leaves(gpt_grad_spec(model, dtype))
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    rotation = 1 if rotate_bytes <= 0 else min(MAX_ROTATION, math.ceil(rotate_bytes / nbytes))
    return cls(model, dtype, sum(math.prod(x.shape) for x in leaves), len(leaves), nbytes,
               rotation)

  def random_tree(self, seed, scale=1.0):
    return _default_maker(self.model, self.dtype)(jax.random.key(seed), scale)


@jax.jit
def f32_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree.leaves(tree)))


def _f64_chunks(leaf, chunk=1 << 24):
  flat = np.asarray(leaf.astype(F32)).reshape(-1)
  for start in range(0, flat.size, chunk):
    yield flat[start:start + chunk].astype(np.float64)


def f64_norm(tree):
  """The tree's global norm, summed in float64 on the host."""
  return math.sqrt(sum(float(np.dot(c, c)) for leaf in jax.tree.leaves(tree)
                       for c in _f64_chunks(leaf)))


def max_rel_err_vs_f64(got, tree, factor):
  """max |got - tree * factor| / |tree * factor| over every element, the product in float64
  on the host (0 / 0 counts as 0)."""
  worst = 0.0
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
    for gc, xc in zip(_f64_chunks(g), _f64_chunks(x)):
      want = xc * factor
      diff = np.abs(gc - want)
      rel = np.where(diff == 0, 0.0, diff / np.maximum(np.abs(want), np.finfo(np.float64).tiny))
      worst = max(worst, float(rel.max(initial=0.0)))
  return worst


# --- layouts over a mesh ("data",) ---------------------------------------------------------


def fsdp_spec(shape, n):
  """P("data") on the first dimension `n` divides, else P() (replicated)."""
  for i, d in enumerate(shape):
    if d % n == 0:
      return P(*([None] * i + [AXIS]))
  return P()


class Layout:
  """A way to place a tree: "fsdp" (each leaf split on its first dimension the device count
  divides, else replicated), "replicated" (every leaf whole on every device), or "single"
  (the whole tree on the first device)."""

  def __init__(self, name, mesh, spec_tree):
    self.name, self.mesh = name, mesh
    self.n = mesh.devices.size
    self.specs = None if name == "single" else jax.tree.map(lambda x: self.spec(x.shape),
                                                             spec_tree)
    self.shardings = self.shardings_like(spec_tree)
    self.scalar = self.sharding(())
    self._make = random_tree_maker(spec_tree, self.shardings)

  def spec(self, shape):
    return fsdp_spec(shape, self.n) if self.name == "fsdp" else P()

  def sharding(self, shape):
    if self.name == "single":
      # jax.sharding.SingleDeviceSharding is deprecated where its factory exists.
      make = (getattr(jax.sharding, "make_single_device_sharding", None)
              or jax.sharding.SingleDeviceSharding)
      return make(jax.devices()[0])
    return NamedSharding(self.mesh, self.spec(shape))

  def shardings_like(self, tree):
    """The sharding of each leaf of `tree` (arrays or shape structs) in this layout: a
    leaf's placement depends on its shape only, so an optimizer state that mirrors the
    parameters is laid out as they are."""
    return jax.tree.map(lambda x: self.sharding(x.shape), tree)

  def tree(self, seed, scale=1.0):
    """Standard normals times `scale` (the same values in every layout), placed."""
    return self._make(jax.random.key(seed), scale)

  def sharded_leaves(self):
    if self.specs is None:
      return 0
    return sum(1 for s in jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, P)) if s)


def device_bytes(tree):
  """The largest number of bytes of the tree's shards that one device holds."""
  per_device = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values())
