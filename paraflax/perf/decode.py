"""`paraflax perf decode`: every generate decoder of the method table (`paraflax.methods`) on
random weights of a shape, warm: milliseconds per decode step against the weight-read floor,
tokens per forward, tokens/s, and greedy equality with AR; optionally XLA's cost analysis of
each decoder's step (`decoding/cost.py`: bytes, FLOPs and ops against the floor),
transformers' `generate` on the same weights and device, and a profile of each decoder's
call."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from paraflax import methods
from paraflax.devices import floor_ms
from paraflax.perf.shapes import model_config, random_model

SMALL_DRAFTER = dict(d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=384)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  shape: str = "qwen2.5-0.5b"
  layers: int | None = None
  dtype: str = "float32"  # float32 with "highest" matmuls: greedy exactness holds
  attention: str | None = None
  decoders: tuple = tuple(methods.names())  # CLI names; AR is the reference
  batches: tuple = (1, 8)
  prompt_len: int = 64  # random 8-token phrases repeated (what prompt lookup is for)
  new_tokens: int = 512
  repeats: int = 3  # best of
  drafter: dict = dataclasses.field(default_factory=lambda: dict(SMALL_DRAFTER))
  transformers: bool = False  # add transformers' `generate` on the same weights (rows
  #   with decoder "transformers"), through a Hugging Face directory
  profile: str | None = None  # a directory: one traced call per decoder, its summary in the row
  profile_decoders: tuple | None = None  # the decoders `profile` traces (None: every one)
  cost: bool = False  # XLA's cost analysis of each decoder's step (one more compile each)


def repetitive_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """`n` prompts of `length` tokens, each a random 8-token phrase repeated."""
  rng = np.random.default_rng(seed)
  return [np.resize(rng.integers(4, vocab, 8), length).tolist() for _ in range(n)]


def drafter_config(kind: str, cfg, drafter: dict = SMALL_DRAFTER):
  """The config of a drafter with the target's vocabulary: a small AR model ("ar") or a DEER
  block-diffusion drafter of the same size ("diffusion")."""
  from paraflax.model.config import ModelConfig
  extra = {"mask_token_id": 2, "sep_token_id": 3} if kind == "diffusion" else {}
  return ModelConfig(vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
                     tie_embeddings=True, dtype=cfg.dtype, param_dtype=cfg.dtype,
                     **drafter, **extra)


def drafter_model(kind: str, cfg, plan: DecodePlan):
  """A random drafter (`drafter_config`) with the target's attention (`plan.attention`)."""
  return random_model(drafter_config(kind, cfg, plan.drafter), seed=1, attention=plan.attention)


def timed(call, repeats: int) -> tuple[object, float, float]:
  """(host copy of the result, first call seconds (compile included), best warm seconds)."""
  import jax

  from paraflax.evaluation.overhead import best_of
  t0 = time.perf_counter()
  out = jax.device_get(call())
  return out, time.perf_counter() - t0, best_of(call, repeats)


def measure(call, repeats: int) -> dict:
  """The figures of one decoder on one batch (`call` runs `pf.generate`), and its tokens."""
  out, first, best = timed(call, repeats)
  tokens = int(out.lengths.sum())
  steps = int(out.forwards.max())  # loop iterations: the longest row's forwards
  return {"tokens_per_forward": tokens / int(out.forwards.sum() + out.prefill_forwards.sum()),
          "tokens_per_s": tokens / best, "ms_per_step": 1e3 * best / max(steps, 1),
          "steps": steps, "draft_forwards": int(out.draft_forwards.sum()),
          "compile_s": max(first - best, 0.0), "rows": [r[:n].tolist() for r, n in
                                                        zip(out.tokens, out.lengths)]}


def run(plan: DecodePlan, add, log) -> list[str]:
  """One row per (batch, decoder); AR runs first as every row's reference (a row of its own
  when named). Returns the errors of the decoders that failed (the others still run)."""
  import contextlib

  import jax
  from flax import nnx

  from paraflax.decoding.core import resolve_steps_per_iter
  from paraflax.decoding.generate import generate
  specs = [methods.spec(name) for name in plan.decoders]  # unknown names: before any work
  specs = [methods.METHODS["ar"]] + [m for m in specs if m.name != "ar"]
  cfg = model_config(plan.shape, plan.dtype, plan.layers)
  model = random_model(cfg, attention=plan.attention)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  floor = floor_ms(weight_bytes, jax.devices()[0].device_kind)
  head = {"kind": "decode", "shape": plan.shape, "dtype": plan.dtype, "layers": cfg.n_layers,
          "prompt_len": plan.prompt_len, "new_tokens": plan.new_tokens}
  drafts, errors = {}, []
  precision = (jax.default_matmul_precision("highest") if plan.dtype == "float32"
               else contextlib.nullcontext())
  with precision:
    for b in plan.batches:
      prompts = repetitive_prompts(b, plan.prompt_len, cfg.vocab_size)
      ar = None
      for m in specs:
        if m.drafter and m.drafter not in drafts:
          drafts[m.drafter] = drafter_model(m.drafter, cfg, plan)
        call = lambda m=m, prompts=prompts: generate(
            model, prompts, m.make(), plan.new_tokens, eos_id=None,
            draft_model=drafts.get(m.drafter))
        try:
          r = measure(call, plan.repeats)
        except Exception as e:  # one decoder's failure is a finding; the others still run
          errors.append(f"decode: {m.name} batch {b}: {type(e).__name__}: {e}"[:400])
          log(errors[-1])
          if ar is None:
            break  # no reference: the batch's other decoders cannot be compared
          continue
        rows = r.pop("rows")
        ar = ar or {**r, "rows": rows}
        if m.name not in plan.decoders:
          continue  # the reference only
        if plan.cost:
          r.update(step_cost(model, m, b, plan, drafts.get(m.drafter)))
        if plan.profile and m.name in (plan.profile_decoders or plan.decoders):
          from paraflax.perf.trace import profiled
          r["trace"] = profiled(call, Path(plan.profile), f"{m.name}_batch{b}")
          r["kernels_per_step"] = r["trace"].get("device_events", 0) / max(r["steps"], 1)
        per = resolve_steps_per_iter(None, m.make(), plan.new_tokens, model.run.backend())
        row = add({**head, "decoder": m.name, "settings": m.describe(), "batch": b,
                   "defaults": plan.attention is None,
                   "steps_per_iter": per, **r,
                   "speedup_vs_ar": r["tokens_per_s"] / ar["tokens_per_s"],
                   "exact_vs_ar": same_rows(ar["rows"], rows), "weight_bytes": weight_bytes,
                   "floor_ms": floor, "vs_floor": floor and r["ms_per_step"] / floor})
        log(f"[decode] batch {b} {m.name}: {row['ms_per_step']:.3f} ms/step, "
            f"{row['tokens_per_forward']:.2f} tokens/forward, {row['tokens_per_s']:.1f} "
            f"tokens/s, exact {row['exact_vs_ar']:.2f}")
      if plan.transformers and ar is not None:
        hf = hf_generate(model, prompts, plan.new_tokens)
        log(f"[decode] batch {b} transformers: {hf.get('skipped') or hf['tokens_per_s']}")
        if "skipped" not in hf:
          same = same_rows(ar["rows"], hf.pop("rows"))
          add({**head, "decoder": "transformers", "batch": b, **hf, "tokens_per_forward": 1.0,
               "speedup_vs_ar": hf["tokens_per_s"] / ar["tokens_per_s"], "exact_vs_ar": same})
  return errors


def step_cost(model, m, batch: int, plan: DecodePlan, draft) -> dict:
  """The row fields of `decoding.cost.step_cost` for method `m` as `run` times it: per decode
  step, the bytes XLA's cost analysis says the compiled loop body accesses, its FLOPs and
  ops, and the bytes against the floor (every weight once and the filled cache)."""
  from paraflax.decoding.cost import step_cost as analyse
  c = analyse(model, m.make(), batch=batch, cache_len=plan.prompt_len,
              max_new_tokens=plan.new_tokens, draft_model=draft)
  return {"step_bytes": c["bytes_accessed"], "step_flops": c["flops"], "step_ops": c["ops"],
          "floor_bytes": c["floor_bytes"], "bytes_per_floor": c["bytes_per_floor"],
          "steps_per_iter": c["steps_per_iter"]}


def same_rows(reference: list, rows: list) -> float:
  """The fraction of `rows` equal to the `reference` row at the same index."""
  return float(np.mean([a == b for a, b in zip(reference, rows)]))


def hf_generate(model, prompts, new: int) -> dict:
  """transformers' greedy `generate` of `new` tokens for `prompts` (one batch, equal lengths)
  on `model`'s weights exported to a Hugging Face directory: warm figures and the tokens; or
  {"skipped": why} when torch has no device for this backend."""
  import tempfile

  import jax
  try:
    import torch
    import transformers
  except ImportError as e:
    return {"skipped": f"torch/transformers not installed ({e.name})"}
  if jax.default_backend() == "cpu":
    device = "cpu"
  elif torch.cuda.is_available():
    device = "cuda"
  else:
    return {"skipped": f"torch {torch.__version__} has no CUDA here: a CPU torch against JAX "
                       f"on {jax.default_backend()} would be no comparison"}
  from paraflax.hf import export_hf
  with tempfile.TemporaryDirectory() as tmp:
    export_hf(model, tmp)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
  hf = hf.to(device).eval()
  hf.generation_config.eos_token_id = None  # as ours (eos_id=None): `new` tokens per row
  ids = torch.tensor(prompts, device=device)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def run(n):
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False, pad_token_id=0)
    sync()
    return out[:, ids.shape[1]:].tolist()

  with torch.no_grad():
    run(8)  # warm-up
    t0 = time.perf_counter()
    rows = run(new)
    seconds = time.perf_counter() - t0
  return {"settings": f"transformers {transformers.__version__}, torch {torch.__version__} "
                      f"({device})", "tokens_per_s": len(prompts) * new / seconds,
          "ms_per_step": 1e3 * seconds / new, "rows": rows}
