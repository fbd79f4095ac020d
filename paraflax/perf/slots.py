"""`paraflax perf slots`: the slot cost c(k), the time of a decode forward with k query slots
over a filled cache divided by that of a one-slot forward (what a parallel decoder pays for
its wider forwards), for causal chunks and TiDAR's k + k^2 slots with its own mask."""

from __future__ import annotations

import dataclasses

from paraflax.perf.shapes import model_config, random_model


@dataclasses.dataclass(frozen=True)
class SlotsPlan:
  shape: str = "qwen2.5-0.5b"
  layers: int | None = None  # None: the shape's
  dtype: str = "bfloat16"
  attention: str | None = None  # RunControl.attention (None: "auto")
  cache_len: int = 2048  # filled cache slots
  slots: tuple = (1, 4, 16, 64)  # causal chunk widths (the first is the reference)
  tidar_k: tuple = (4, 8)  # TiDAR's k + k^2 slots for each k
  short_cache: int = 256  # the causal widths `short_slots` again over this cache (0: off)
  short_slots: tuple = (1, 16, 64)
  batches: tuple = (1, 8)
  repeats: int = 5  # best of
  inner: int | None = None  # forwards per timed program (None: 8, or 1 on a CPU)


def widths(slots, tidar_k=()) -> list[tuple[int, str, int]]:
  """(query slots, mask name, k) of each timed forward: causal chunks, then TiDAR's."""
  return [(k, "causal", k) for k in slots] + [(k + k * k, f"tidar k={k}", k) for k in tidar_k]


def slot_costs(model, cache_len: int, repeats: int, batch: int, forwards, inner: int = 1):
  """Per width of `forwards` (`widths`; the first is the reference): the best of `repeats`
  rounds of one k-slot forward over a cache of `batch` rows holding `cache_len` tokens, each
  round timing every width once (a burst of load from other jobs hits all widths alike).
  `inner` > 1 times a loop of that many forwards in one program (device time without the
  per-call dispatch, as a decode loop runs). Yields {slots, mask, forward_ms, vs_one_slot,
  compile_s}."""
  import time

  import jax
  import jax.numpy as jnp

  from paraflax.decoding import state as st
  from paraflax.evaluation.overhead import best_of
  from paraflax.model import masks
  from paraflax.model.cache import init_cache
  fwd = st.Forward.of(model)
  cache = init_cache(model.cfg, batch, cache_len + max(w for w, _, _ in forwards))
  cache = cache.replace(lengths=jnp.full((batch,), cache_len, jnp.int32))

  @jax.jit
  def loop(f, tok, pos, mask, c):
    def body(i, acc):  # tokens vary with i, so XLA cannot hoist the forward out of the loop
      return acc + f(tok + i % 2, pos, mask, c)[0].max().astype(jnp.float32)
    return jax.lax.fori_loop(0, inner, body, jnp.float32(0))

  calls, compile_s = [], []
  for width, mask_name, k in forwards:
    mask = (masks.decode(cache.lengths, cache.slots, width) if mask_name == "causal"
            else masks.tidar_decode(cache.lengths, cache.slots, k))
    pos = cache.lengths[:, None] + jnp.arange(width)[None]
    tok = jnp.full((batch, width), 7, jnp.int32)
    calls.append(lambda tok=tok, pos=pos, mask=mask: loop(fwd, tok, pos, mask, cache))
    t0 = time.perf_counter()
    jax.block_until_ready(calls[-1]())
    compile_s.append(time.perf_counter() - t0)
  best = [float("inf")] * len(calls)
  for _ in range(repeats):
    best = [min(b, best_of(c, 1) / inner) for b, c in zip(best, calls)]
  return [{"slots": w, "mask": m, "forward_ms": b * 1e3, "vs_one_slot": b / best[0],
           "compile_s": s} for (w, m, _), b, s in zip(forwards, best, compile_s)]


def run(plan: SlotsPlan, add, log) -> list[str]:
  """c(k) rows per cache length and batch (`add` takes each row); the errors of the sweeps
  that failed (the others still run)."""
  import jax
  inner = plan.inner or (1 if jax.default_backend() == "cpu" else 8)
  cfg = model_config(plan.shape, plan.dtype, plan.layers)
  model = random_model(cfg, attention=plan.attention)
  sweeps = [(plan.cache_len, widths(plan.slots, plan.tidar_k))]
  if plan.short_cache:
    sweeps.append((plan.short_cache, widths(plan.short_slots)))
  errors = []
  for cache_len, forwards in sweeps:
    for b in plan.batches:
      try:
        rows = slot_costs(model, cache_len, plan.repeats, b, forwards, inner)
      except Exception as e:  # one sweep's failure is a finding; the others still run
        errors.append(f"slots: cache {cache_len} batch {b}: {type(e).__name__}: {e}"[:400])
        log(errors[-1])
        continue
      for r in rows:
        add({"kind": "slots", "shape": plan.shape, "dtype": plan.dtype, "layers": cfg.n_layers,
             "attention": model.run.attention_for(cfg, r["slots"], cached=True),
             "cache_len": cache_len, "batch": b, **r, "repeats": plan.repeats, "inner": inner})
        log(f"[slots] cache {cache_len} batch {b} slots {r['slots']:>3} ({r['mask']}): "
            f"{r['forward_ms']:.3f} ms, c = {r['vs_one_slot']:.2f}")
  return errors


def cache_shares(rows: list[dict]) -> list[dict]:
  """Per (shape, batch, slots) timed over two cache lengths: the share of the longer-cache
  forward that its extra cache slots cost, 1 - t(short) / t(long)."""
  out, groups = [], {}
  for r in rows:
    if r["kind"] == "slots" and r["mask"] == "causal":
      groups.setdefault((r["device"], r["shape"], r["dtype"], r["batch"], r["slots"]),
                        []).append(r)
  for (_, shape, _, batch, slots), rs in groups.items():
    if len(rs) == 2:
      short, long = sorted(rs, key=lambda r: r["cache_len"])
      out.append({"shape": shape, "batch": batch, "slots": slots,
                  "short_cache": short["cache_len"], "long_cache": long["cache_len"],
                  "short_ms": short["forward_ms"], "long_ms": long["forward_ms"],
                  "cache_share": 1 - short["forward_ms"] / long["forward_ms"]})
  return out
