"""xla vs xla_chunked attention on this backend: decode steps over a cache, and a training-size
forward + backward (wall time, and XLA's temporaries of the compiled function).

  python scripts/attention_bench.py [--dtype float32|bfloat16] [--quick]

Qwen2.5-0.5B attention shapes: 14 query heads, 2 kv heads, head width 64, batch 1;
float32 with `jax_default_matmul_precision="highest"` (as the exactness tests run).
"""

import argparse
import time

import jax
import jax.numpy as jnp

from paraflax.model import attention, masks

H, HKV, D = 14, 2, 64


def _time(fn, *args, repeats: int) -> float:
  """Median wall seconds of `fn(*args)` after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


def decode(impl: str, s: int, t: int, dtype, repeats: int) -> float:
  """Milliseconds of one attention call of t query rows over a full s-slot cache."""
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (1, t, H, D), dtype)
  k, v = (jax.random.normal(x, (1, t, HKV, D), dtype) for x in ks[1:3])
  ck, cv = (jax.random.normal(x, (1, s, HKV, D), dtype) for x in ks[3:])
  mask = masks.decode(jnp.array([s]), s, t)
  fn = jax.jit(lambda q, k, v, ck, cv, m: attention.attend(
      q, k, v, m, attention=impl, cache_kv=(ck, cv)))
  return 1e3 * _time(fn, q, k, v, ck, cv, mask, repeats=repeats)


def train(impl: str, t: int, dtype, repeats: int) -> tuple[float, float]:
  """(temporaries MiB, seconds) of forward + backward (w.r.t. q, k, v) over a causal row."""
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (1, t, H, D), dtype)
  k, v = (jax.random.normal(x, (1, t, HKV, D), dtype) for x in ks[1:])
  mask = masks.causal(jnp.array([t]), t)

  def loss(q, k, v, m):
    return jnp.sum(attention.attend(q, k, v, m, attention=impl).astype(jnp.float32) ** 2)

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  temp = fn.lower(q, k, v, mask).compile().memory_analysis().temp_size_in_bytes
  return temp / 2 ** 20, _time(fn, q, k, v, mask, repeats=repeats)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--quick", action="store_true", help="fewer repeats, no 4096-token training")
  args = p.parse_args()
  jax.config.update("jax_default_matmul_precision", "highest")
  dtype, reps = jnp.dtype(args.dtype), 3 if args.quick else 7
  print(f"backend {jax.default_backend()}, {args.dtype}, heads {H}/{HKV}, width {D}, batch 1")
  print("decode step over a 4096-slot cache: ms per attention call")
  for t in (1, 16, 72, 272):
    row = {impl: decode(impl, 4096, t, dtype, 10 * reps) for impl in ("xla", "xla_chunked")}
    print(f"  T={t:<4} " + "  ".join(f"{k} {v:8.3f}" for k, v in row.items()))
  print("training forward + backward over a causal row: temporaries MiB, seconds")
  for t in (128, 512, 2048) if args.quick else (128, 512, 2048, 4096):
    row = {impl: train(impl, t, dtype, reps) for impl in ("xla", "xla_chunked")}
    print(f"  T={t:<4} " + "  ".join(f"{k} {m:8.1f} MiB {s:7.3f} s" for k, (m, s) in row.items()))


if __name__ == "__main__":
  main()
