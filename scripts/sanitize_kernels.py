"""The custom calls alone, on trees that reach every path of their kernels; for compute-sanitizer.

    compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py "scale call,odd sizes"
    compute-sanitizer --tool racecheck python scripts/sanitize_kernels.py "scale call,odd sizes"
    python scripts/sanitize_kernels.py            # every case, without a sanitizer
    python scripts/sanitize_kernels.py --groups   # the groups the sanitizers run, one line each

Inputs are placed with device_put and read back with NumPy, and every reference is computed
on the host in float64, so the only GPU kernels that run are clipjax's three (and XLA's
small copies): the sanitizer checks ours, not XLA's. Each case prints a line; the exit
status is 1 if any result is wrong. Runs on a CPU too (the custom call's CPU handler).
"""

import sys

import jax
import numpy as np

import clipjax

F32 = np.float32
DTYPES = {"f32": np.float32, "bf16": jax.numpy.bfloat16, "f16": np.float16}


def leaves_of(rng, spec):
  """[(shape, dtype, scale)] -> NumPy leaves."""
  return [(scale * rng.standard_normal(shape)).astype(DTYPES[dtype])
          for shape, dtype, scale in spec]


def f64_sumsq(x):
  v = np.asarray(x, np.float64).reshape(-1)
  return float(np.dot(v, v))


CASES = {
    "mixed dtypes": [((1000, 3), "f32", 1.0), ((33333,), "bf16", 1.0), ((4097,), "f16", 1.0)],
    "odd sizes": [((n,), "f16", 1.0) for n in (1, 3, 7, 32767, 32769, 65535, 0, 99991)]
                 + [((5, 0), "f32", 1.0)],
    "one big leaf": [((3_000_001,), "f32", 0.01)],
    "1100 leaves (two tables)": [(((i * 37) % 200 + 1,), "bf16" if i % 3 else "f32", 1.0)
                                 for i in range(1100)],
    "below max_norm": [((70000,), "f32", 1e-5), ((123,), "bf16", 1e-5)],
}


# The sanitizers run the cases in these groups, one process each: over all of them in one
# process (racecheck, and memcheck at 988e3c9), and once over five, compute-sanitizer itself
# crashed (SIGSEGV) on an H200 after cases that passed, with no error or hazard reported.
GROUPS = ("mixed dtypes,odd sizes,scale call",
          "one big leaf,1100 leaves (two tables),below max_norm",
          "per tensor,nan propagates,nan zero-fills",
          "inf propagates,inf zero-fills")


def check(name, leaves, max_norm=1.0, **kw):
  per_tensor = kw.get("mode") == "per_tensor"
  sumsq = [f64_sumsq(x) for x in leaves]
  norm = np.sqrt(sum(sumsq))
  clip = jax.jit(lambda t: clipjax.clip_tree(t, max_norm, impl="ffi", **kw), donate_argnums=0)
  res = clip([jax.device_put(x) for x in leaves])
  got = [np.asarray(y) for y in res.updates]
  errors = []
  if np.isfinite(norm) and abs(float(res.global_norm) - norm) > 1e-6 * norm:
    errors.append(f"norm {float(res.global_norm)!r} vs float64 {norm!r}")
  for i, (x, y) in enumerate(zip(leaves, got)):
    n = np.sqrt(sumsq[i]) if per_tensor else norm
    if kw.get("on_nonfinite") == "zero" and not np.isfinite(norm):
      want = np.zeros_like(x)
    elif n <= max_norm:
      want = x
    else:
      with np.errstate(invalid="ignore"):  # inf * 0: NaN, as the clip gives it
        want = (x.astype(F32) * F32(max_norm / n)).astype(x.dtype)
    tol = float(np.finfo(F32).eps) * 2 if x.dtype == np.float32 else 1e-2
    a, b = np.asarray(y, np.float64), np.asarray(want, np.float64)
    same_nan = np.isnan(a) == np.isnan(b)
    close = np.isclose(a, b, rtol=tol, atol=0) | (np.isnan(a) & np.isnan(b))
    if not (same_nan.all() and close.all()):
      errors.append(f"leaf {i}: {int((~close).sum())} of {x.size} elements wrong")
  print(f"{'ok  ' if not errors else 'FAIL'} {name}" + ("" if not errors else ": " + "; ".join(
      errors[:3])), flush=True)
  return not errors


def check_scale(name, leaves):
  """The scale-only call (the sharded clip's last stage): leaf i kept, scaled or zeroed."""
  from clipjax._backend import ffi as _ffi  # noqa: PLC0415
  n = len(leaves)
  scale = np.linspace(0.25, 0.75, n).astype(F32)
  keep, zero = np.arange(n) % 3 == 0, np.arange(n) % 3 == 2
  run = jax.jit(lambda ls: _ffi.scale_call(scale, 0, keep, zero, ls), donate_argnums=0)
  got = run([jax.device_put(x) for x in leaves])
  errors = []
  for i, (x, y) in enumerate(zip(leaves, got)):
    want = (x if keep[i] else np.zeros_like(x) if zero[i]
            else (x.astype(F32) * scale[i]).astype(x.dtype))
    if not np.array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32)):
      errors.append(f"leaf {i} ({x.dtype}, {x.size} elements) wrong")
  print(f"{'ok  ' if not errors else 'FAIL'} {name}" + ("" if not errors else ": " + "; ".join(
      errors[:3])), flush=True)
  return not errors


def all_cases():
  """[(name, run)]: every case, each a function that checks it and returns True if right."""
  rng = np.random.default_rng(0)
  cases = [(name, lambda name=name, spec=spec: check(name, leaves_of(rng, spec)))
           for name, spec in CASES.items()]

  def per_tensor():
    leaves = leaves_of(rng, [((50000,), "f32", 0.02), ((300,), "bf16", 0.02), ((7, 7), "f16", 1)])
    return check("per tensor", leaves, mode="per_tensor")
  cases.append(("per tensor", per_tensor))
  for bad in (np.nan, np.inf):
    def nonfinite(bad=bad, policy="propagate"):
      leaves = leaves_of(rng, [((70000,), "f32", 1.0), ((100,), "bf16", 1.0)])
      leaves[0][65536] = bad
      if policy == "propagate":
        return check(f"{bad} propagates", leaves)
      return check(f"{bad} zero-fills", leaves, on_nonfinite="zero")
    cases.append((f"{bad} propagates", nonfinite))
    cases.append((f"{bad} zero-fills", lambda bad=bad: nonfinite(bad, "zero")))
  cases.append(("scale call", lambda: check_scale(
      "scale call", leaves_of(rng, CASES["mixed dtypes"] + CASES["odd sizes"]))))
  return cases


def main():
  # Optional: a comma-separated list of case names to run alone (e.g. "scale call"), or
  # --groups: print the groups the sanitizers run.
  if sys.argv[1:] == ["--groups"]:
    print("\n".join(GROUPS))
    return 0
  cases = all_cases()
  only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
  if only and only - {name for name, _ in cases}:
    print(f"unknown cases: {sorted(only - {n for n, _ in cases})}; "
          f"known: {[n for n, _ in cases]}")
    return 2
  ok = True
  for name, run in cases:
    if only is None or name in only:
      ok &= run()
  print("all cases pass" if ok else "SOME CASES FAILED", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
