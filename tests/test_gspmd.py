"""The plain drop-in under `jax.jit` on sharded gradients: nothing is gathered.

`optax.chain(clipjax.andrea_clip(1.0), optax.adamw(...))`, with no mesh or specs, on
gradients that carry NamedShardings over a ("fsdp", "tp") mesh: each device reduces
its own shards, an all-reduce combines a few floats per leaf, and every update keeps
its sharding. Checked on both implementations, on Auto and Explicit mesh axes, against
float64 and against the same step on one device; the pure-JAX one both as XLA partitions
it (on CPUs and TPUs) and as it runs on CUDA GPUs (sums by rows, partitioned per shard).

Like tests/test_sharded.py, these run where jax sees an even number >= 2 of devices,
and otherwise in subprocesses on 4, 8 and 2 CPU devices (`test_on_cpu_devices`, in the
slow set).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import clipjax
from conftest import (SHARDED_IMPLS, compiled_collectives, f64_norm, impl_named,
                      multi_device_file)


test_on_cpu_devices, impl = multi_device_file(__file__)


def _mesh(fsdp=AxisType.Auto, tp=None):
  """The ("fsdp", "tp") mesh, its axes of these types (tp of fsdp's unless given)."""
  n = jax.device_count()
  return jax.make_mesh((n // 2, 2), ("fsdp", "tp"), axis_types=(fsdp, tp or fsdp))


def _layout(n):
  """Leaves of every kind of sharding on the ("fsdp", "tp") mesh, as (shape, dtype, spec)."""
  f = n // 2  # the fsdp axis size
  return {
      "rows": ((4 * f, 24), jnp.float32, P("fsdp", None)),
      "cols": ((24, 8), jnp.float32, P(None, "tp")),
      "both": ((4 * f, 6), jnp.float32, P("fsdp", "tp")),
      "replicated": ((16,), jnp.float32, P()),
      "vector": ((8,), jnp.float32, P("tp")),
      "half": ((2 * f, 12), jnp.bfloat16, P("fsdp")),
  }


def _tree(layout, seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), len(layout))
  return {name: (scale * jax.random.normal(key, shape)).astype(dtype)
          for key, (name, (shape, dtype, _)) in zip(keys, layout.items())}


def _specs(layout):
  return {name: spec for name, (_, _, spec) in layout.items()}


def _put(tree, mesh, specs):
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def _assert_sharded_as(tree, mesh, specs):
  for k, x in tree.items():
    want = NamedSharding(mesh, specs[k])
    assert x.sharding.is_equivalent_to(want, x.ndim), (k, x.sharding, specs[k])


def _assert_only_small_all_reduces(hlo, num_leaves):
  """No all-gather, all-to-all or permute; all-reduces of a few floats per leaf at most."""
  found = compiled_collectives(hlo)
  assert {op for op, _ in found} <= {"all-reduce"}, found
  assert all(size <= 3 * num_leaves + 8 for _, size in found), found


# --- the clip alone -------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("impl_name", [*SHARDED_IMPLS, "auto"])
def test_plain_transform_keeps_shards_and_the_whole_trees_norm(devices, impl_name, axis_type,
                                                               request):
  impl = impl_named(impl_name, request)
  mesh, layout = _mesh(axis_type), _layout(devices)
  specs, grads = _specs(layout), _tree(_layout(devices), seed=0)
  tx = clipjax.andrea_clip(1.0, impl=impl)
  update = jax.jit(tx.update)
  sharded = _put(grads, mesh, specs)
  state = tx.init(sharded)

  _assert_only_small_all_reduces(update.lower(sharded, state).compile().as_text(), len(grads))
  updates, new_state = update(sharded, state)
  _assert_sharded_as(updates, mesh, specs)

  want_norm = f64_norm(grads)
  np.testing.assert_allclose(float(new_state.global_norm), want_norm, rtol=1e-6)
  assert bool(new_state.clipped)
  # The same updates as one device clipping the whole tree, to float32 rounding.
  whole = clipjax.clip_tree(grads, 1.0, impl="jax" if impl == "auto" else impl)
  for k in grads:
    tol = 1e-6 if grads[k].dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(updates[k], np.float32),
                               np.asarray(whole.updates[k], np.float32), rtol=tol, atol=1e-8)
    np.testing.assert_allclose(np.asarray(updates[k], np.float64),
                               np.asarray(grads[k], np.float64) / want_norm, rtol=tol, atol=1e-8)


def test_global_norm_of_sharded_leaves(devices, impl):
  mesh, layout = _mesh(), _layout(devices)
  grads = _tree(layout, seed=3)
  norm = jax.jit(lambda t: clipjax.global_norm(t, impl=impl))
  sharded = _put(grads, mesh, _specs(layout))
  _assert_only_small_all_reduces(norm.lower(sharded).compile().as_text(), len(grads))
  np.testing.assert_allclose(float(norm(sharded)), f64_norm(grads), rtol=1e-6)


def test_the_custom_call_runs_per_shard(devices):
  """Each device clips its own shards; the shard norms of a group of leaves split over the
  same mesh axes cross devices in one all-reduce (XLA may join some)."""
  mesh, layout = _mesh(), _layout(devices)
  specs, grads = _specs(layout), _tree(layout, seed=1)
  clip = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates)
  hlo = clip.lower(_put(grads, mesh, specs)).compile().as_text()
  assert 'custom_call_target="clipjax_andrea_scale"' in hlo
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  groups = {frozenset(a for a in jax.tree.leaves(tuple(spec)) if sizes[a] > 1)
            for spec in specs.values()} - {frozenset()}
  collectives = [op for op, _ in compiled_collectives(hlo)]
  assert collectives and set(collectives) == {"all-reduce"}, collectives
  assert len(collectives) <= len(groups), (collectives, groups)
  hlo_dtype = {jnp.float32: "f32", jnp.bfloat16: "bf16"}
  for k, (shape, dtype, spec) in layout.items():
    if NamedSharding(mesh, spec).shard_shape(shape) != shape:  # no buffer holds it whole
      assert f"{hlo_dtype[dtype]}[{','.join(map(str, shape))}]{{" not in hlo, k


def test_the_custom_call_is_traced_for_the_partitioner(devices):
  """With devices to split over, the clip reaches XLA's partitioner as one partitionable
  call (on a single device it is traced as its custom calls alone: test_many_leaves.py)."""
  grads = _tree(_layout(devices), seed=4)
  text = str(jax.make_jaxpr(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates)(grads))
  assert "custom_partitioning" in text


# Which form of the pure-JAX clip each lowering holds, by the mesh's axis types: on Auto
# axes, the clip partitioned per shard (custom_partitioning); on Explicit ones, in a
# shard_map over the leaves' types; where Explicit and Auto axes mix, leaf by leaf, since
# only the partitioner knows the layout on the Auto ones.
PER_SHARD_FORMS = {
    "auto": ((AxisType.Auto, AxisType.Auto), "CustomSPMDPartitioning"),
    "explicit": ((AxisType.Explicit, AxisType.Explicit), "manual"),
    "mixed": ((AxisType.Explicit, AxisType.Auto), None),
}
LOWERED_FORMS = {"CustomSPMDPartitioning": ("CustomSPMDPartitioning",),
                 "manual": ("sdy.manual_computation", "SPMDFullToShardShape")}


@pytest.mark.parametrize("axes", list(PER_SHARD_FORMS))
def test_the_pure_jax_clip_is_partitioned_per_shard_where_lowered_for_cuda(devices, axes):
  """On CUDA the pure-JAX clip stacks each device's own row sums, in a clip partitioned per
  shard like the custom call, or in a shard_map over the types' specs; lowered for the CPU,
  XLA partitions it, leaf by leaf. Its norm is the whole tree's in every form."""
  axis_types, want = PER_SHARD_FORMS[axes]
  mesh, layout = _mesh(*axis_types), _layout(devices)
  grads = _tree(layout, seed=5)
  sharded = _put(grads, mesh, _specs(layout))
  clip = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax").updates).trace(sharded)
  found = {}
  for platform in ("cuda", "cpu"):
    text = clip.lower(lowering_platforms=(platform,)).as_text()
    found[platform] = [form for form, marks in LOWERED_FORMS.items()
                       if any(m in text for m in marks)]
  assert found == {"cuda": [want] if want else [], "cpu": []}, found


@pytest.mark.parametrize("axes", list(PER_SHARD_FORMS))
def test_each_form_of_the_pure_jax_clip_by_rows_keeps_shards(devices, axes, sum_by_rows_here):
  """The forms of PER_SHARD_FORMS, run (the CPU made to take CUDA's): the whole tree's norm,
  each leaf's, the updates sharded as they came, and no gradient-sized collective."""
  mesh, layout = _mesh(*PER_SHARD_FORMS[axes][0]), _layout(devices)
  specs, grads = _specs(layout), _tree(layout, seed=6)
  clip = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax"))
  sharded = _put(grads, mesh, specs)
  _assert_only_small_all_reduces(clip.lower(sharded).compile().as_text(), len(grads))
  result = clip(sharded)
  _assert_sharded_as(result.updates, mesh, specs)
  np.testing.assert_allclose(float(result.global_norm), f64_norm(grads), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(result.leaf_norms),
                             [f64_norm(grads[k]) for k in sorted(grads)], rtol=1e-6)


def test_vmap_over_sharded_trees_clips_each_tree(devices, impl):
  """A batch of sharded trees (per-example gradients, say), each clipped by its own norm:
  the custom call once per tree in sequence, the pure-JAX clip batched by XLA."""
  mesh, layout = _mesh(), _layout(devices)
  trees = [_tree(layout, seed=30 + i, scale=1.0 + i) for i in range(3)]
  batch = _put({k: jnp.stack([t[k] for t in trees]) for k in layout}, mesh,
               {k: P(None, *spec) for k, spec in _specs(layout).items()})
  clip = jax.vmap(lambda t: clipjax.clip_tree(t, 1.0, impl=impl))
  if impl == "jax":
    assert "scan" not in str(jax.make_jaxpr(clip)(batch))
  result = jax.jit(clip)(batch)
  norms = [f64_norm(t) for t in trees]
  np.testing.assert_allclose(np.asarray(result.global_norm), norms, rtol=1e-6)
  for i, (tree, norm) in enumerate(zip(trees, norms)):
    for k in tree:
      tol = 1e-6 if tree[k].dtype == jnp.float32 else 1e-2
      np.testing.assert_allclose(np.asarray(result.updates[k][i], np.float64),
                                 np.asarray(tree[k], np.float64) / norm, rtol=tol, atol=1e-8)


def test_below_max_norm_is_bit_identical(devices, impl):
  mesh, layout = _mesh(), _layout(devices)
  specs, grads = _specs(layout), _tree(layout, seed=2)
  tx = clipjax.andrea_clip(1e6, impl=impl)
  updates, state = jax.jit(tx.update)(_put(grads, mesh, specs), tx.init(grads))
  assert not bool(state.clipped)
  for k in grads:
    np.testing.assert_array_equal(np.asarray(updates[k]).view(np.uint8),
                                  np.asarray(grads[k]).view(np.uint8))


def test_leaf_norms_and_spikes_on_sharded_leaves(devices, impl):
  """The per-leaf norms of the whole leaves, and the spike policy, with nothing gathered."""
  mesh, layout = _mesh(), _layout(devices)
  specs = _specs(layout)
  tx = clipjax.andrea_clip(1.0, impl=impl, spike=clipjax.ZScoreSpike(warmup_steps=2))
  update = jax.jit(tx.update)
  state = tx.init(_tree(layout, seed=0))
  for seed, scale in ((20, 1.0), (21, 1.0), (22, 1.0), (23, 50.0)):
    grads = _tree(layout, seed, scale)
    sharded = _put(grads, mesh, specs)
    updates, state = update(sharded, state)
  _assert_only_small_all_reduces(update.lower(sharded, state).compile().as_text(), len(grads))
  _assert_sharded_as(updates, mesh, specs)
  np.testing.assert_allclose(np.asarray(state.leaf_norms),
                             [f64_norm(grads[k]) for k in sorted(grads)], rtol=1e-6)
  assert bool(state.spike) and int(state.spike_count) == 1  # the 50x step
  assert f64_norm(updates) <= 1.0 + 2.0**-8  # clipped to max_norm (the bf16 leaf rounds)


# --- a jitted, donated FSDP step with AdamW ---------------------------------------------


def _uneven_layout(n):
  """One leaf whose first dimension its axis does not divide (constrained inside the step)."""
  return {**_layout(n), "uneven": ((n // 2 * 3 + 1, 5), jnp.float32, P())}


CASES = {
    "mixed": dict(),
    "uneven": dict(layout=_uneven_layout, inner={"uneven": P("fsdp", None)}),
    "per_tensor": dict(clip=dict(mode="per_tensor")),
    "kernel_scale": dict(clip=dict(scale="kernel")),  # the custom call's k_grad_scale
    "zero_nonfinite": dict(clip=dict(on_nonfinite="zero"), poison=np.nan),
    "propagate_inf": dict(clip=dict(on_nonfinite="propagate"), poison=np.inf),
    "injected_max_norm": dict(injected=True),
}


def _transform(case, impl, clip):
  if clip == "optax":
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
  if case.get("injected"):
    inject = optax.inject_hyperparams(
        lambda max_norm: optax.chain(clipjax.andrea_clip(max_norm, impl=impl),
                                     optax.adamw(1e-2, weight_decay=0.1)))
    return inject(max_norm=0.5)
  return optax.chain(clipjax.andrea_clip(1.0, impl=impl, **case.get("clip", {})),
                     optax.adamw(1e-2, weight_decay=0.1))


def _step_fn(tx, mesh, inner):
  def step(params, opt_state, grads):
    if mesh is not None:  # layouts that only exist inside the step (uneven shards)
      grads = {k: (jax.lax.with_sharding_constraint(g, NamedSharding(mesh, inner[k]))
                   if k in inner else g) for k, g in grads.items()}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(step, donate_argnums=(0, 1))


def _run_steps(tx, params, grads_list, mesh=None, specs=None, inner=None):
  put = (lambda t: _put(t, mesh, specs)) if mesh is not None else (lambda t: t)
  params = put(jax.tree.map(jnp.copy, params))  # the step donates them
  opt_state = jax.jit(tx.init)(params)
  step = _step_fn(tx, mesh, inner or {})
  compiled = step.lower(params, opt_state, put(grads_list[0])).compile()
  for grads in grads_list:
    params, opt_state = step(params, opt_state, put(grads))
  return params, opt_state, compiled


@pytest.mark.parametrize("case_name", list(CASES))
def test_fsdp_adamw_step_matches_one_device(devices, impl, case_name):
  case = CASES[case_name]
  if impl == "jax" and case.get("clip", {}).get("scale") == "kernel":
    pytest.skip("scale='kernel' is the custom call's; the pure-JAX path always fuses")
  layout = case.get("layout", _layout)(devices)
  mesh, specs = _mesh(), _specs(layout)
  params = _tree(layout, seed=10)
  grads_list = [_tree(layout, seed=11 + i, scale=3.0) for i in range(2)]
  if "poison" in case:  # a non-finite value in one shard of one leaf, on the first step
    grads_list[0]["rows"] = grads_list[0]["rows"].at[-1, 0].set(case["poison"])

  tx = _transform(case, impl, "andrea")
  got, got_state, compiled = _run_steps(tx, params, grads_list, mesh, specs, case.get("inner"))
  want, want_state, _ = _run_steps(_transform(case, impl, "andrea"), params, grads_list)

  _assert_sharded_as(got, mesh, specs)
  got_clip, want_clip = clipjax.clip_state(got_state), clipjax.clip_state(want_state)
  np.testing.assert_allclose(float(got_clip.global_norm), float(want_clip.global_norm),
                             rtol=1e-6)
  assert int(got_clip.nonfinite_count) == int(want_clip.nonfinite_count)
  for k in params:
    tol = 1e-5 if params[k].dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32),
                               rtol=tol, atol=1e-6)

  # No gradient-sized collective beyond those of optax's clip in the same step, and no
  # more memory per device.
  optax_tx = _transform(case, impl, "optax")
  *_, optax_compiled = _run_steps(optax_tx, params, grads_list[:1], mesh, specs,
                                  case.get("inner"))
  big = lambda c: sorted(x for x in compiled_collectives(c.as_text()) if x[1] > 3 * len(params) + 8)
  assert big(compiled) == big(optax_compiled)
  # Scratch beyond optax's: the norms, flags and the custom call's workspace (a few floats
  # per leaf, each buffer aligned), never a gathered leaf.
  ours, theirs = compiled.memory_analysis(), optax_compiled.memory_analysis()
  if ours is not None and theirs is not None:
    slack = 8192 + 256 * len(params)
    assert ours.temp_size_in_bytes <= theirs.temp_size_in_bytes + slack, (
        ours.temp_size_in_bytes, theirs.temp_size_in_bytes)
