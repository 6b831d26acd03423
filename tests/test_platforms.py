"""Which code a clip runs, chosen per platform when XLA lowers the program: the custom
call or pure JAX for impl="auto", and the pure-JAX path's form (its sums by rows on CUDA,
leaf by leaf elsewhere). Lowering for a platform needs no device of it, so the CUDA
choices are checked on the CPU."""

import re

import jax
import jax.numpy as jnp
import pytest

import clipjax
from conftest import has_cuda, random_tree


@pytest.mark.skipif(has_cuda(), reason="on a CUDA machine auto takes the custom call")
def test_auto_on_cpu_takes_the_pure_jax_path():
  tree = random_tree(jax.random.key(10), [(100,)], scale=3.0)
  lowered = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="auto")).lower(tree).as_text()
  assert "clipjax_andrea_clip" not in lowered
  lowered = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi")).lower(tree).as_text()
  assert "clipjax_andrea_clip" in lowered


def _traced_pure_jax_clip():
  """The pure-JAX clip of three leaves, traced once for every platform it is lowered for:
  rows of 768 (a matrix and a vector) and of 5."""
  tree = {"a": jnp.ones((768, 64)), "b": jnp.ones((768,)), "c": jnp.ones((5, 2, 3))}
  return jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax").updates).trace(tree)


def _reduction_results(stablehlo: str) -> set:
  """The result types of every reduction of the leaves (each of a variadic one's results),
  leaving out the totals: the leaves' sums added up, across dimension 0."""
  return {t for results in re.findall(
              r"stablehlo\.reduce.*?across dimensions = \[(?!0\]).*?-> (tensor<[^>]*>|\([^)]*\))",
              stablehlo)
          for t in re.findall(r"tensor<[^>]*>", results)}


def test_the_pure_jax_form_is_chosen_for_the_platform_lowered_for():
  """On CUDA the pure-JAX clip reduces each leaf to its row sums (three f32[rows], one
  variadic reduction) and finishes those of the same length together (f32[leaves, 3]);
  elsewhere it reduces each leaf whole (f32[3]). Decided when lowering, so it holds for a
  program lowered for another platform than this machine's, or for several."""
  traced = _traced_pure_jax_clip()
  by_rows = {"tensor<768xf32>", "tensor<5xf32>", "tensor<2x3xf32>", "tensor<1x3xf32>"}
  by_leaf = {"tensor<3xf32>"}
  for platforms, want, not_want in [(("cuda",), by_rows, by_leaf), (("cpu",), by_leaf, by_rows),
                                    (("cpu", "cuda"), by_rows | by_leaf, set())]:
    found = _reduction_results(traced.lower(lowering_platforms=platforms).as_text())
    assert want <= found and not found & not_want, (platforms, found)


def _barriers(stablehlo: str) -> list:
  """The result types of each optimization barrier, as sets."""
  return [set(re.findall(r"tensor<[^>]*>", line.split(":", 1)[1]))
          for line in stablehlo.splitlines() if "stablehlo.optimization_barrier" in line]


def test_the_cuda_form_fixes_its_kernels_with_barriers():
  """XLA:GPU keeps an optimization barrier until after fusion (XLA:CPU drops it before, so
  no CPU compile can show this), and the CUDA form relies on two of them: one over the
  leaves' row sums, so that each leaf is reduced by a kernel of its own, and one over the
  sums of each length's stacked row sums, so that XLA does not fuse one of those
  reductions into the permutation back to the leaves' order, where one thread adds up a
  whole row (slower in the example's 120M step: examples/benchmark.py --kernels shows it)."""
  traced = _traced_pure_jax_clip()
  barriers = _barriers(traced.lower(lowering_platforms=("cuda",)).as_text())
  assert {"tensor<768xf32>", "tensor<5xf32>"} in barriers, barriers
  # Lengths 768 (a and b) and 5 (c): each length's leaves' three sums.
  assert {"tensor<2x3xf32>", "tensor<1x3xf32>"} in barriers, barriers
