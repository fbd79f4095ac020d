"""`paraflax perf numerics`: the numerics of the paths a device picks, against references.

- Per objective: the loss and the gradient of one batch with the attention under test (None:
  "auto", which resolves to the device's fused kernel: cuDNN on a GPU in 16-bit) against the
  dense reference (`reference`, "xla") on the same parameters and batch, in the compute dtype.
  A row states its tolerance and whether it held.
- Per generate decoder: greedy tokens equal to greedy AR's, token for token, in float32 with
  "highest" matmuls (`perf decode`'s `exact_vs_ar` at the plan's shape), the decoders' own
  settings.

- The GPU decode kernel (`model/decode_attention.py`, what "auto" runs for a 16-bit decode
  step on a GPU) against the dense path over the same cache, in float32 and bf16, for one
  row and a block of 16 (interpreted where the backend is not a GPU).

- The GPU decode layer (`model/decode_layer.py`: the layer in five kernels "auto" runs for
  such a step) against the model's layer over the same cache: its output's change of the
  residual stream and the chunk's keys and values, likewise.

- The greedy head (`model/greedy_head.py`: a greedy step's argmax without logits) against
  the argmax of the model's head: how far below each row's maximal logit its pick lies.

One row of kind `numerics` per check (`check`: "loss_grad", "decode_kernel", "decode_layer",
"greedy_head" or "greedy_equal_ar").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paraflax import methods
from paraflax.perf import decode
from paraflax.perf.train import RECIPES, TrainPlan, recipe


@dataclasses.dataclass(frozen=True)
class NumericsPlan:
  shape: str = "micro"
  layers: int | None = None
  dtype: str = "bfloat16"  # the objectives' compute dtype (decoders: float32, "highest")
  objectives: tuple = tuple(RECIPES)
  batch: int = 1
  seq_len: int = 256
  attention: str | None = None  # the kernel under test; None: "auto" for this device
  reference: str = "xla"  # the dense path
  decoders: tuple = tuple(methods.names())
  batches: tuple = (1, 4)  # the decoders' batches
  new_tokens: int = 48
  loss_rtol: float = 2e-2  # |loss - reference| / |reference|
  grad_rtol: float = 5e-2  # ||grad - reference|| / ||reference||, over every parameter
  kernel_rtol: dict = dataclasses.field(  # the decode kernel's ||out - dense|| / ||dense||
      default_factory=lambda: {"float32": 1e-3, "bfloat16": 2e-2})


def loss_and_grad(cfg, attention: str, params, graphdef, batch, key):
  """The objective's loss and gradient of `params` on `batch`, attention `attention`."""
  import jax
  from flax import nnx

  from paraflax.training.objectives.protocol import objective
  loss_fn = objective(cfg.objective).bind(cfg.objective_args)
  run = dataclasses.replace(cfg.run, attention=attention)

  def loss(p):
    model = nnx.merge(graphdef, p)
    model.run = run
    return loss_fn(model, batch, key)[0]

  return jax.device_get(jax.jit(jax.value_and_grad(loss))(params))


def compare(loss, grad, ref_loss, ref_grad) -> dict:
  """The loss's relative difference; the gradient's relative L2 difference, cosine and largest
  absolute difference, over every parameter."""
  import jax
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  g, r = flat(grad), flat(ref_grad)
  norm = np.linalg.norm(r)
  return {"loss": float(loss), "loss_ref": float(ref_loss),
          "loss_rel": float(abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)),
          "grad_rel_l2": float(np.linalg.norm(g - r) / max(norm, 1e-30)),
          "grad_cos": float(g @ r / max(np.linalg.norm(g) * norm, 1e-30)),
          "grad_max_abs": float(np.max(np.abs(g - r)))}


def objective_row(name: str, plan: NumericsPlan) -> dict:
  import jax

  from paraflax.perf.batches import synthetic_batch
  from paraflax.training.run.step import init_params
  tp = TrainPlan(shape=plan.shape, layers=plan.layers, dtype=plan.dtype, batch=plan.batch,
                 seq_len=plan.seq_len, attention=plan.attention)
  cfg = recipe(name, tp, plan.seq_len)
  graphdef, params = init_params(cfg.model, seed=0, run=cfg.run)
  batch = {k: jax.numpy.asarray(v) for k, v in synthetic_batch(cfg).items()}
  key = jax.random.key(0)
  attention = cfg.run.resolved(cfg.model, plan.seq_len)["attention"]
  got = loss_and_grad(cfg, cfg.run.attention, params, graphdef, batch, key)
  ref = loss_and_grad(cfg, plan.reference, params, graphdef, batch, key)
  r = compare(*got, *ref)
  ok = r["loss_rel"] <= plan.loss_rtol and r["grad_rel_l2"] <= plan.grad_rtol
  return {"check": "loss_grad", "objective": name, "layers": cfg.model.n_layers,
          "batch": plan.batch, "seq_len": plan.seq_len, "attention": attention,
          "reference": plan.reference, **r, "loss_rtol": plan.loss_rtol,
          "grad_rtol": plan.grad_rtol, "ok": bool(ok and np.isfinite(r["loss"]))}


def decode_kernel_row(plan: NumericsPlan, dtype: str, rows: int) -> dict:
  """The decode kernel's output against the dense path's: the plan's model heads, 4 rows of
  a 2-layer cache of 257 slots filled to different lengths, `rows` query rows, `dtype`."""
  import jax
  import jax.numpy as jnp

  from paraflax.model import attention, masks
  from paraflax.model.decode_attention import decode_attend
  from paraflax.perf.shapes import model_config
  cfg = model_config(plan.shape, dtype)  # heads narrower than the kernel takes: 16 wide
  h, hkv, s, dt = cfg.n_heads, cfg.n_kv_heads, 257, jnp.dtype(dtype)
  d = max(cfg.dim_per_head, 16)
  k = jax.random.split(jax.random.key(0), 5)
  cache = [jax.random.normal(k[i], (2, 4, s, hkv, d), dt) for i in (0, 1)]
  q = jax.random.normal(k[2], (4, rows, h, d), dt)
  chunk = [jax.random.normal(k[i], (4, rows, hkv, d), dt) for i in (3, 4)]
  mask = masks.decode(jnp.array([1, 60, 200, s - 1]), s, rows)
  interpret = jax.default_backend() != "gpu"
  with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
    got = jax.jit(lambda *a: decode_attend(*a, 1, interpret=interpret))(q, *chunk, mask, *cache)
    want = jax.jit(lambda q, k, v, m, ck, cv: attention._dense(q, k, v, m, (ck[1], cv[1])))(
        q, *chunk, mask, *cache)
  got, want = (np.asarray(x, np.float64) for x in (got, want))
  rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  return {"check": "decode_kernel", "decoder": f"{rows} query rows", "dtype": dtype,
          "rows": rows, "batch": 4, "seq_len": s, "attention": "gpu_decode", "reference": "xla",
          "heads": [h, hkv, d], "interpret": interpret, "rel_l2": rel,
          "rtol": plan.kernel_rtol[dtype], "ok": bool(rel <= plan.kernel_rtol[dtype])}


def decode_layer_row(plan: NumericsPlan, dtype: str, rows: int) -> dict:
  """The decode layer against the model's layer (dense attention): the plan's model width and
  heads (heads at least 64 wide), random q/k/v biases, 4 rows of a 2-layer cache of 257 slots
  filled to different lengths, `rows` query rows, `dtype`; the relative L2 error over the
  layer's change of x and the chunk's keys and values."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from paraflax.model import decode_layer, masks
  from paraflax.model.cache import CacheLayer
  from paraflax.model.transformer import Block, rope_frequencies
  from paraflax.perf.shapes import model_config
  cfg = model_config(plan.shape, dtype)
  head = max(cfg.dim_per_head, 64)
  cfg = dataclasses.replace(cfg, d_model=cfg.n_heads * head, qkv_bias=True, param_dtype=dtype)
  layer, s, dt = Block(cfg, nnx.Rngs(0)), 257, jnp.dtype(dtype)
  k = jax.random.split(jax.random.key(0), 6)
  for name, key in zip(("bq", "bk", "bv"), k[3:]):
    p = getattr(layer.attn, name)
    p[...] = 0.1 * jax.random.normal(key, p.shape, dt)
  shape = (2, 4, s, cfg.n_kv_heads, head)
  cache = CacheLayer(*(jax.random.normal(k[i], shape, dt) for i in (0, 1)), 1)
  x = jax.random.normal(k[2], (4, rows, cfg.d_model), dt)
  lengths = jnp.array([1, 60, 200, s - rows])
  positions = lengths[:, None] + jnp.arange(rows)[None, :]
  mask, inv_freq = masks.decode(lengths, s, rows), rope_frequencies(cfg)
  interpret = jax.default_backend() != "gpu"
  with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
    want = layer(x, positions, mask, cache, inv_freq, rows, "xla", jax.default_backend())
    got = decode_layer.block(layer, x, positions, mask, cache, inv_freq, interpret=interpret)
  flat = lambda out: np.concatenate([np.asarray(a, np.float64).ravel() for a in
                                     (out[0] - x, *out[1])])
  got, want = flat(got), flat(want)
  rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  return {"check": "decode_layer", "decoder": f"{rows} query rows", "dtype": dtype,
          "rows": rows, "batch": 4, "seq_len": s, "attention": "gpu_decode", "reference": "xla",
          "width": [cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head, cfg.d_ff],
          "interpret": interpret, "rel_l2": rel, "rtol": plan.kernel_rtol[dtype],
          "ok": bool(rel <= plan.kernel_rtol[dtype])}


def greedy_head_row(plan: NumericsPlan, dtype: str, rows: int) -> dict:
  """The greedy head's picks against the model's head: 4 x `rows` random final-normed rows,
  the plan's tied embedding in `dtype`. `rel_l2` here is the largest gap, relative to the
  row's largest logit, between that logit and the logit (the reference's) of the pick: 0
  where every pick is a maximum; `agree` the share of picks equal to the reference's."""
  import jax
  import jax.numpy as jnp

  from paraflax.model import greedy_head
  from paraflax.model.transformer import logits
  from paraflax.perf.shapes import model_config
  cfg, dt = model_config(plan.shape, dtype), jnp.dtype(dtype)
  k = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(k[0], (4 * rows, cfg.d_model), dt)
  w = (cfg.d_model ** -0.5 * jax.random.normal(k[1], (cfg.vocab_size, cfg.d_model))).astype(dt)
  interpret = jax.default_backend() != "gpu"
  with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
    got = jax.jit(lambda x, w: greedy_head.argmax(x, w, tied=True, interpret=interpret))(x, w)
    ref = jax.jit(lambda x, w: logits(x[None], w.T)[0])(x, w)
  ref, got = np.asarray(ref, np.float64), np.asarray(got)
  top = ref.max(-1)
  gap = float(((top - ref[np.arange(len(got)), got]) / np.maximum(np.abs(top), 1.0)).max())
  return {"check": "greedy_head", "decoder": f"{rows} query rows", "dtype": dtype,
          "rows": rows, "batch": 4, "vocab": cfg.vocab_size, "reference": "xla",
          "interpret": interpret, "rel_l2": gap, "agree": float((got == ref.argmax(-1)).mean()),
          "rtol": plan.kernel_rtol[dtype], "ok": bool(gap <= plan.kernel_rtol[dtype])}


def run(plan: NumericsPlan, add, log) -> list[str]:
  """The decode kernel's, the decode layer's and the greedy head's rows, one row per
  objective, then one per (decoder, batch); the errors of the checks that failed to run (the
  others still run). A check that ran and missed its tolerance is a row with `ok` false, and
  an error too."""
  errors = []
  for name in plan.objectives:
    if name not in RECIPES:
      raise ValueError(f"unknown objective {name!r}: pick from {', '.join(RECIPES)}")
  for what, check in (("kernel", decode_kernel_row), ("layer", decode_layer_row),
                      ("head", greedy_head_row)):
    for dtype in ("float32", "bfloat16"):  # first: seconds each, and a default's only check
      for rows in (1, 16):
        try:
          row = add({"kind": "numerics", "shape": plan.shape, **check(plan, dtype, rows)})
        except Exception as e:  # a finding; the other checks still run
          errors.append(f"numerics: decode {what} {dtype} x{rows}: {type(e).__name__}: {e}"[:400])
          log(errors[-1])
          continue
        log(f"[numerics] decode {what} {dtype}, {rows} rows: rel L2 {row['rel_l2']:.2e}: "
            f"{'ok' if row['ok'] else 'OUT OF TOLERANCE'}")
        if not row["ok"]:
          errors.append(f"numerics: decode {what} {dtype} x{rows}: differs from the dense path")
  for name in plan.objectives:
    try:
      row = add({"kind": "numerics", "shape": plan.shape, "dtype": plan.dtype,
                 **objective_row(name, plan)})
    except Exception as e:  # one objective's failure is a finding; the others still run
      errors.append(f"numerics: {name}: {type(e).__name__}: {e}"[:400])
      log(errors[-1])
      continue
    log(f"[numerics] {name} {row['attention']} vs {row['reference']}: loss rel "
        f"{row['loss_rel']:.2e}, grad rel L2 {row['grad_rel_l2']:.2e} (cos "
        f"{row['grad_cos']:.5f}): {'ok' if row['ok'] else 'OUT OF TOLERANCE'}")
    if not row["ok"]:
      errors.append(f"numerics: {name}: {row['attention']} differs from {row['reference']} "
                    f"beyond tolerance")
  if plan.decoders:
    def greedy_row(r):
      row = add({"kind": "numerics", "check": "greedy_equal_ar", "shape": plan.shape,
                 "dtype": "float32", "decoder": r["decoder"], "settings": r["settings"],
                 "batch": r["batch"], "new_tokens": r["new_tokens"],
                 "exact_vs_ar": r["exact_vs_ar"], "tokens_per_forward":
                 r["tokens_per_forward"], "ok": r["exact_vs_ar"] == 1.0})
      if not row["ok"]:
        errors.append(f"numerics: {r['decoder']} batch {r['batch']}: greedy tokens differ "
                      f"from AR's in {1 - r['exact_vs_ar']:.0%} of rows")
      return {**r, **row}  # `decode.run` logs its timing fields
    dp = decode.DecodePlan(shape=plan.shape, layers=plan.layers, dtype="float32",
                           decoders=plan.decoders, batches=plan.batches,
                           new_tokens=plan.new_tokens, repeats=1)
    errors += decode.run(dp, greedy_row, log)
  return errors
