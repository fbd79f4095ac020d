"""XLA's cost analysis of one decode step, as the compiled `pf.generate` loop runs it.

`step_cost(model, decoder, batch=1, cache_len=256)` compiles the loop for abstract inputs (no
weights are needed: an `nnx.eval_shape` model will do), takes the `while_loop`'s body out of
the optimised program and asks XLA's cost analysis for its bytes accessed and flops, per
decode step. Work XLA hoisted out of the loop (loop-invariant weight casts) and the prefill
are not counted: they run once per call. Against the bytes stands the floor, what any step
must read: every weight once in the compute dtype and the filled cache (the drafter's too).

The figures are those of the backend this runs on. On CPU, XLA computes 16-bit matmuls in
float32 and keeps float32 copies of 16-bit weights (hoisted out of the loop), so a bf16 step
reads float32 weights there: compare CPU figures with CPU figures.
"""

from __future__ import annotations

import collections
import functools
import math
import time

import jax
import jax.numpy as jnp

from paraflax import hlo
from paraflax.decoding import checks, core
from paraflax.decoding import state as st
from paraflax.model.cache import cache_slots

_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_COSTS = ("bytes accessed", "flops", "transcendentals")

_loop = jax.jit(core.decode_loop, static_argnames=("max_new_tokens", "steps_per_iter"))


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _analyse(text: str, comps: dict, name: str):
  """(XLA's cost analysis, the work-launching instructions by opcode) of computation `name`.
  XLA's cost analysis counts one trip of a nested `while`: one with a known trip count n
  (a `fori_loop`) is counted n times here, in both; one without, once."""
  full = hlo.cost_analysis(hlo.as_entry(text, name))
  cost = collections.Counter({k: full.get(k, 0.0) for k in _COSTS})
  ops = collections.Counter()
  for ins in comps[name]:
    if ins.op in hlo.FREE or ins.op.endswith("-done"):
      continue
    if ins.op != "while":
      ops[ins.op] += 1
      continue
    trips = ins.trip_count or 1
    inner_cost, inner_ops = _analyse(text, comps, ins.attribute("body").lstrip("%"))
    for k, v in inner_cost.items():
      cost[k] += (trips - 1) * v
    for k, v in inner_ops.items():
      ops[k] += trips * v
  return cost, ops


def loop_body(comps: dict, entry: str, cache_shape: str) -> str:
  """The body of the entry's `while` whose state holds the cache (`cache_shape`, e.g.
  "bf16[24,1,273,2,64]"): the decode loop, not a prefill's RNG loop."""
  bodies = [ins.attribute("body").lstrip("%") for ins in comps[entry]
            if ins.op == "while" and cache_shape in ins.shape]
  if len(bodies) != 1:
    raise RuntimeError(f"expected one decode loop carrying a {cache_shape} cache in the "
                       f"compiled program, found {len(bodies)}")
  return bodies[0]


def cache_shape(cfg, batch: int, slots: int) -> str:
  """The HLO shape text of the decode loop's K (or V) cache."""
  return (f"{_HLO_DTYPES[cfg.dtype]}[{cfg.n_layers},{batch},{slots},{cfg.n_kv_heads},"
          f"{cfg.dim_per_head}]")


def bytes_at(tree, dtype) -> int:
  """Bytes of a pytree's arrays, floating ones counted at `dtype`'s width."""
  def nbytes(x):
    return math.prod(x.shape) * jnp.dtype(
        dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype).itemsize
  return sum(map(nbytes, jax.tree.leaves(tree)))


def cache_bytes(cfg, batch: int, slots: int) -> int:
  """Bytes of K and V of `slots` cache slots for `batch` rows, in the compute dtype."""
  return (2 * cfg.n_layers * batch * slots * cfg.n_kv_heads * cfg.dim_per_head
          * jnp.dtype(cfg.compute_dtype).itemsize)


def step_cost(model, decoder=None, *, batch: int = 1, cache_len: int = 256,
              max_new_tokens: int = 16, draft_model=None,
              steps_per_iter: int | None = None) -> dict:
  """XLA's cost analysis of one decode step of `decoder` (default AR) over a cache holding
  `cache_len` tokens per row (the prompt buffer's width; the loop's cache has room for
  `max_new_tokens` and the decoder's lookahead past it), `batch` rows, the loop running
  `steps_per_iter` steps per iteration (None: as `pf.generate` runs it on this backend; the
  figures are its body's divided by them).

  Returns a JSON-able dict: `bytes_accessed`, `flops`, `transcendentals` and `ops` (the work
  instructions, a kernel each on a GPU, `ops_by_kind` by opcode) per step; `weight_bytes` (the
  target's and drafter's floating weights in their compute dtypes), `cache_bytes` (their
  filled caches), `floor_bytes` (the two) and `bytes_per_floor`; `backend`, `compile_s`.
  """
  cfg = model.cfg
  draft_cfg = None if draft_model is None else draft_model.cfg
  decoder, max_new_tokens, eos_E = core.check_setup(cfg, decoder, max_new_tokens, None, draft_cfg)
  batch, cache_len = checks.integer("batch", batch, 1), checks.integer("cache_len", cache_len, 1)
  unroll = core.resolve_steps_per_iter(steps_per_iter, decoder, max_new_tokens,
                                       model.run.backend())
  if cache_len + max_new_tokens > cfg.max_seq_len:
    raise ValueError(f"cache_len ({cache_len}) + max_new_tokens ({max_new_tokens}) exceeds the "
                     f"model's max_seq_len {cfg.max_seq_len}")
  fwd = _abstract(st.Forward.of(model))
  draft = None if draft_model is None else _abstract(st.Forward.of(draft_model))
  args = (jax.ShapeDtypeStruct((batch, cache_len), jnp.int32),
          jax.ShapeDtypeStruct((batch,), jnp.int32),
          jax.eval_shape(functools.partial(jax.random.key, 0)), _abstract(eos_E))
  start = time.perf_counter()
  text = _loop.lower(fwd, draft, decoder, *args, max_new_tokens=max_new_tokens,
                    steps_per_iter=unroll).compile().as_text()
  compile_s = time.perf_counter() - start
  slots = cache_slots(decoder.cache_capacity(cache_len, max_new_tokens), model.run.backend())
  comps, entry = hlo.computations(text)
  body = loop_body(comps, entry, cache_shape(cfg, batch, slots))
  cost, ops = _analyse(text, comps, body)
  cost = {k: v / unroll for k, v in cost.items()}
  weight_bytes = bytes_at(fwd.params, cfg.compute_dtype)
  kv_bytes = cache_bytes(cfg, batch, cache_len)
  if draft is not None:
    weight_bytes += bytes_at(draft.params, draft_cfg.compute_dtype)
    kv_bytes += cache_bytes(draft_cfg, batch, cache_len)
  floor = weight_bytes + kv_bytes
  return {
      "decoder": type(decoder).__name__, "batch": batch, "cache_len": cache_len,
      "dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "backend": jax.default_backend(),
      "bytes_accessed": cost["bytes accessed"], "flops": cost["flops"],
      "transcendentals": cost["transcendentals"],
      "ops": sum(ops.values()) / unroll,
      "ops_by_kind": {k: v / unroll for k, v in ops.most_common()}, "steps_per_iter": unroll,
      "weight_bytes": weight_bytes, "cache_bytes": kv_bytes, "floor_bytes": floor,
      "bytes_per_floor": cost["bytes accessed"] / floor, "compile_s": round(compile_s, 2)}
