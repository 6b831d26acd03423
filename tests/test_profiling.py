"""What the benchmarks read from a profile and a compiled program: the GPU's busy time, the
kernels by name and by class (the fusion XLA made, the shape it writes), how two steps'
classes differ, the collectives in an optimized module, and what wrote each operand of the
clip's custom call. Synthetic traces and HLO, or programs compiled for the CPU."""

from types import SimpleNamespace as NS

from benchlib import profiling


def test_busy_seconds_is_the_union_of_stream_activity():
  ev = lambda start, dur: NS(start_ns=start, duration_ns=dur)  # noqa: E731
  streams = [NS(name="Stream #1", events=[ev(0, 100), ev(50, 100)]),  # overlap: 0..150
             NS(name="Stream #2", events=[ev(300, 50)]),
             NS(name="XLA Modules", events=[ev(0, 10_000)])]            # spans gaps: ignored
  assert profiling.busy_seconds(streams) == 200e-9
  assert profiling.busy_seconds([NS(name="XLA Ops", events=[ev(0, 40)])]) == 40e-9
  assert profiling.busy_seconds([NS(name="XLA Modules", events=[ev(0, 40)])]) is None


def test_kernel_seconds_ranks_the_kernels_of_the_stream_lines():
  ev = lambda name, dur: NS(name=name, start_ns=0, duration_ns=dur)  # noqa: E731
  lines = [NS(name="Stream #1", events=[ev("k_grad_scale", 300), ev("k_grad_norm_final", 50),
                                        ev("k_grad_scale", 300)]),
           NS(name="Stream #2", events=[ev("k_grad_norm_partial", 400)]),
           NS(name="XLA Ops", events=[ev("custom-call", 10_000)])]  # not a stream: ignored
  got = profiling.kernel_seconds(lines)
  assert list(got) == ["k_grad_scale", "k_grad_norm_partial", "k_grad_norm_final"]
  assert got["k_grad_scale"] == 600e-9 and got["k_grad_norm_final"] == 50e-9
  assert profiling.kernel_seconds(lines, top=1) == {"k_grad_scale": 600e-9, "(other)": 450e-9}


def test_kernel_classes_name_each_kernel_by_its_fusion_and_what_it_writes():
  hlo = """
  %wrapped_slice.36 = bf16[768,768]{1,0} fusion(%gemm_fusion_dot.425), kind=kLoop
  %wrapped_slice.37 = bf16[768,768]{1,0} fusion(%gemm_fusion_dot.425), kind=kLoop
  %loop_add_fusion = (f32[768]{0}, f32[768]{0}, f32[768]{0}) fusion(%a, %b), kind=kLoop
  ROOT %tuple.9 = (f32[2]{0}) tuple(%x)
  """
  shapes = profiling.instruction_shapes(hlo)
  assert shapes["wrapped_slice.36"] == "bf16[768,768]"
  assert shapes["loop_add_fusion"] == "(f32[768], f32[768], ...)"
  assert shapes["tuple.9"] == "(f32[2])"
  ev = lambda name, dur: NS(name=name, start_ns=0, duration_ns=dur)  # noqa: E731
  partial = "void clipjax::(anonymous namespace)::k_grad_norm_partial<256>(clipjax::device::T)"
  lines = [NS(name="Stream #1", events=[ev("wrapped_slice_36", 2000),
                                        ev("wrapped_slice_37", 1000),
                                        ev("loop_add_fusion", 500), ev(partial, 9000)]),
           NS(name="XLA Ops", events=[ev("wrapped_slice.36", 5000)])]  # not a stream: ignored
  got = profiling.kernel_classes(lines, shapes)
  assert got == {"wrapped_slice bf16[768,768]": [2, 3000e-9],
                 "loop_add_fusion (f32[768], f32[768], ...)": [1, 500e-9],
                 "k_grad_norm_partial": [1, 9000e-9]}


def test_kernel_deltas_rank_the_classes_a_step_adds_or_drops():
  base = {"gemm_fusion_dot bf16[768,2304]": [12, 500.0],
          "loop_add_fusion (bf16[768], bf16[768])": [110, 165.0],
          "input_reduce_fusion bf16[3072]": [12, 61.5]}
  row = {"gemm_fusion_dot bf16[768,2304]": [12, 501.0],
         "loop_add_fusion (bf16[768], bf16[768])": [10, 30.0],
         "input_reduce_fusion f32[3072]": [12, 62.0],  # a dtype apart: the same kernels
         "wrapped_slice bf16[768,768]": [36, 65.0],
         "k_grad_norm_partial": [1, 55.0]}
  assert profiling.kernel_deltas(row, base, 4) == [
      ("loop_add_fusion (bf16[768], bf16[768])", 110, 10, -135.0),
      ("wrapped_slice bf16[768,768]", 0, 36, 65.0), ("k_grad_norm_partial", 0, 1, 55.0),
      ("gemm_fusion_dot bf16[768,2304]", 12, 12, 1.0)]
  [reduce] = [d for d in profiling.kernel_deltas(row, base, 9)
              if d[0].startswith("input_reduce")]
  assert reduce == ("input_reduce_fusion f32[3072]", 12, 12, 0.5)


def test_collectives_are_counted_with_their_largest_buffer():
  hlo = """
  %all-reduce.1 = f32[197,3]{1,0} all-reduce(f32[197,3]{1,0} %p), replica_groups={{0,1}}
  %ag = (f32[8,16]{1,0}, f32[4]{0}) all-gather-start(f32[4,16]{1,0} %a, f32[2]{0} %b)
  %cc = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="clipjax_andrea_clip"
  """
  got = profiling.hlo_summary(hlo)
  assert got["collectives"] == {"all-reduce": 1, "all-gather": 1}
  assert got["collective_max_elements"] == 591 and got["custom_calls"] == 1


def test_call_operands_name_what_wrote_each_operand_of_the_custom_call():
  """In a compiled update, the clip's custom call reads a parameter as it is, and a slice
  or a product of the step's own making as the fusion XLA wrote for it; bitcasts between
  are looked through, and the call's first operand (max_norm) is not a leaf's."""
  import jax
  import jax.numpy as jnp

  import clipjax

  tx = clipjax.andrea_clip(1.0, impl="ffi")

  def update(a, b):
    tree = {"a": a, "b": (b * 3.0)[:, :16], "c": (b + 1.0).reshape(-1)}
    return tx.update(tree, tx.init(tree))[0]

  a, b = jnp.ones((8, 4)), jnp.ones((4, 32))
  hlo = jax.jit(update).lower(a, b).compile().as_text()
  found = profiling.call_operands(hlo)
  assert sum(found.values()) == 3, found
  assert found.get("parameter f32[8,4]") == 1, found
  assert [k for k in found if k.endswith("f32[4,16]") and "fusion" in k], found
  assert [k for k in found if k.endswith("f32[128]") and not k.startswith("parameter")], found
  assert profiling.hlo_summary(hlo)["call_operands"] == found
  # The scale call's leaves follow its factors and actions. It writes over its leaves, so
  # an argument of the jit that is not donated reaches it through a copy.
  from clipjax._backend import ffi as _ffi
  scaled = jax.jit(lambda a, b: _ffi.scale_call(0.5, 0.0, False, False, [a, (b * 3.0)[:, :16]]))
  found = profiling.call_operands(scaled.lower(a, b).compile().as_text())
  assert sum(found.values()) == 2 and found.get("copy f32[8,4]") == 1, found
  assert profiling.call_operands(jax.jit(lambda x: x * 2).lower(a).compile().as_text()) == {}
