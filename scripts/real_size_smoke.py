"""Real-size smoke run (issue 20, item 6): one real training step of every objective and
`generate` with every decoder, on a Qwen2.5-0.5B-shaped random model, on this CPU.

    python scripts/real_size_smoke.py                                  # everything, 24 layers
    python scripts/real_size_smoke.py --objectives ar,tidar --layers 4 --skip-decode
    python scripts/real_size_smoke.py --remat none --scan-layers false # the plain path

Training (a): each objective's shipped config with the model `--set` to Qwen2.5-0.5B shapes
(bf16 compute, float32 params), `data.seq_len` 1024, batch 1; a synthetic batch of its data
source's shapes with valid contents (Jacobi Forcing rows packed by `jacobi_forcing.example`,
teacher rows with consistent prompt_lens / lengths); the real `step.jit_train_step` with
`optim.optimizer`. Each objective runs in its own subprocess (peak RSS is that process's).
A step whose XLA memory analysis (arguments + outputs - aliased + temporaries) exceeds
`--max-gib` is compiled but not run.

Decoding (b), float32 compute and params (greedy exactness holds in float32): the cost of a
k-slot forward over a filled cache against a one-token forward (k = 1, 4, 16, 64 and TiDAR's
k + k^2 for k = 4, 8 with its own mask), then each decoder's `generate` / `infill` on a
random prompt. Random weights accept few drafts; that is expected.

Writes `smoke.json` and `slot_cost.png` under `--out` (default runs/real_size_smoke/, which
.gitignore covers) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"ar": "tiny_ar", "jacobi_forcing": "jacobi_forcing_r1", "tidar": "tidar_scratch",
           "deer_stage1": "deer_drafter_stage1", "deer_stage2": "deer_drafter",
           "asarm": "asarm"}
QWEN_05B = dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                d_ff=4864, max_seq_len=32768, qkv_bias=True, tie_embeddings=True)
DECODERS = ("ar", "jacobi", "jacobi_mr", "prompt_lookup", "tidar", "speculative", "deer",
            "any_order", "assd")
SLOTS = (1, 4, 16, 64)  # plain causal chunks; TiDAR's k + k^2 for `TIDAR_K` added
TIDAR_K = (4, 8)
GIB = 2 ** 30


def peak_rss_gib() -> float:
  """This process's peak resident set (ru_maxrss is KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run_control(args) -> dict:
  """The ModelConfig run-control overrides the flags ask for (none by default)."""
  sets = {}
  if args.remat is not None:
    sets["model.remat"] = args.remat
  if args.scan_layers is not None:
    sets["model.scan_layers"] = {"auto": "auto", "true": True, "false": False}[args.scan_layers]
  if args.attention is not None:
    sets["model.attention"] = args.attention
  return sets


# ---------------------------------------------------------------- (a) training

def train_config(name: str, args, extra: dict | None = None, shape: dict = QWEN_05B):
  """The objective's shipped config at `shape` (Qwen2.5-0.5B's by default) with `--layers`,
  `--seq-len`, batch 1 (then the run-control flags, then `extra` overrides)."""
  from paraflax.training.config import apply_overrides, load_config
  cfg = load_config(ROOT / "configs" / f"{CONFIGS[name]}.py")
  sets = {f"model.{k}": v for k, v in shape.items()}
  sets.update({"model.n_layers": args.layers, "model.dtype": "bfloat16",
               "model.param_dtype": "float32", "data.seq_len": args.seq_len,
               "data.batch_size": 1, **run_control(args), **(extra or {})})
  return apply_overrides(cfg, sets)


def jacobi_row(length: int, vocab: int, rng: np.random.Generator, n: int = 16) -> dict:
  """One packed Jacobi Forcing row filling `length`: prompt, then noisy/clean block pairs
  (noisy = clean from a random first divergent slot on), through `jacobi_forcing.example`."""
  from paraflax.training.jacobi_forcing import example
  blocks = max(1, (length - length // 8) // (2 * n))
  p = length - 2 * n * blocks
  clean = rng.integers(0, vocab, (blocks, n))
  first = rng.integers(0, n + 1, blocks)  # n: the block had already converged
  noisy = np.where(np.arange(n)[None] >= first[:, None], rng.integers(0, vocab, (blocks, n)),
                   clean)
  return example(rng.integers(0, vocab, p), noisy, clean, length)


def teacher_row(length: int, vocab: int, rng: np.random.Generator) -> dict:
  """One teacher row: a prompt shorter than its buffer, the answer, right-padded with 0."""
  answer = length // 2
  p = (length - answer) * 3 // 4
  tokens = np.zeros(length, np.int32)
  tokens[:p + answer] = rng.integers(0, vocab, p + answer)
  return {"tokens": tokens, "prompt_lens": np.int32(p), "lengths": np.int32(p + answer)}


def synthetic_batch(cfg, seed: int = 0) -> dict:
  """A concrete batch of `cfg`'s data-source shapes (`dry_run.abstract_batch`) with valid
  contents for its source."""
  from paraflax.training.dry_run import abstract_batch
  shapes = abstract_batch(cfg)
  rng = np.random.default_rng(seed)
  b, length, vocab = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  if cfg.data_source == "trajectories":
    rows = [jacobi_row(length, vocab, rng) for _ in range(b)]
  elif cfg.data_source == "teacher":
    rows = [teacher_row(length, vocab, rng) for _ in range(b)]
  else:
    rows = [{"tokens": rng.integers(0, vocab, length)} for _ in range(b)]
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  batch["step"] = np.zeros(b, np.int32)  # kept only when the objective reads it
  out = {}
  for k, s in shapes.items():
    out[k] = np.asarray(batch[k]).astype(s.dtype)
    if out[k].shape != s.shape:
      raise ValueError(f"synthetic {k} has shape {out[k].shape}, the source's is {s.shape}")
  return out


def param_sample(params) -> list[np.ndarray]:
  """The first 256 entries of every parameter (host copies, to see what the step moved)."""
  import jax
  return [np.asarray(jax.device_get(x.ravel()[:256])) for x in jax.tree.leaves(params)]


def compile_step(cfg, graphdef, tx, params, opt_state, batch, key) -> tuple:
  """(compiled `jit_train_step` of `cfg`, compile seconds, XLA bytes: arguments + outputs -
  aliased (donated) + temporaries, temporaries)."""
  from paraflax.training.dry_run import memory_report
  from paraflax.training.objectives import objective
  from paraflax.training.step import jit_train_step
  step = jit_train_step(graphdef, objective(cfg.objective).bind(cfg.objective_args), tx)
  t0 = time.perf_counter()
  compiled = step.lower(params, opt_state, batch, key).compile()
  seconds = time.perf_counter() - t0
  memory = memory_report(compiled)
  return compiled, seconds, memory["total_bytes"], memory["temp_bytes"]


def run_settings(cfg) -> dict:
  """The run control the step compiled with, "auto" resolved (what a training call gets)."""
  from paraflax.model import remat_policy, scans
  return {"remat": remat_policy(cfg.model), "scan_layers": scans(cfg.model, cached=False),
          "attention": cfg.model.attention}


def train_one(name: str, args) -> dict:
  """Init, compile and run one training step of objective `name`; the report."""
  return measure_step(name, train_config(name, args), args.max_gib)


def measure_step(name: str, cfg, max_gib: float, steps: int = 1) -> dict:
  """Init, compile and run `steps` training steps of `cfg` (objective `name`) on a synthetic
  batch; the report (`step_s`: the first run of the compiled step, `step_s_best`: the
  fastest of the `steps`)."""
  import jax
  from paraflax.training import optim
  from paraflax.training.step import init_opt_state, init_params
  report = {"objective": name, "config": f"configs/{CONFIGS[name]}.py",
            "layers": cfg.model.n_layers, "seq_len": cfg.data.seq_len}
  t0 = time.perf_counter()
  graphdef, params = init_params(cfg.model, seed=0)  # its config: remat, scan_layers
  tx = optim.optimizer(cfg.optim, cfg.schedule_steps)
  opt_state = jax.block_until_ready(init_opt_state(tx, params))
  report["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
  report["init_s"] = time.perf_counter() - t0
  batch = {k: jax.numpy.asarray(v) for k, v in synthetic_batch(cfg).items()}
  report["batch"] = {k: [list(v.shape), str(v.dtype)] for k, v in batch.items()}
  key = jax.random.key(0)
  compiled, report["compile_s"], need, temp = compile_step(cfg, graphdef, tx, params, opt_state,
                                                           batch, key)
  report.update(run_settings(cfg), xla_temp_gib=temp / GIB, xla_total_gib=need / GIB)
  if need > max_gib * GIB:
    return {**report, "skipped": f"XLA needs {need / GIB:.1f} GiB > --max-gib {max_gib}",
            "peak_rss_gib": peak_rss_gib()}
  before = param_sample(params)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    params, opt_state, metrics = jax.block_until_ready(compiled(params, opt_state, batch, key))
    times.append(time.perf_counter() - t0)
    if len(times) == 1:  # the first step's effect: parameters moved, loss and grad norm
      moved = [not np.array_equal(a, b) for a, b in zip(before, param_sample(params))]
      first = {k: float(v) for k, v in jax.device_get(metrics).items()}
  report["step_s"], report["step_s_best"] = times[0], min(times)
  return {**report, "loss": first["loss"], "grad_norm": first["grad_norm"],
          "finite": bool(np.isfinite(first["loss"]) and np.isfinite(first["grad_norm"])),
          "params_moved": f"{sum(moved)}/{len(moved)}", "peak_rss_gib": peak_rss_gib()}


# ---------------------------------------------------------------- (b) decoding

def decode_config(args, **extra):
  """The Qwen2.5-0.5B-shaped decode model: float32 compute and params, <mask> = 2."""
  from paraflax.config import ModelConfig
  cfg = {**QWEN_05B, "n_layers": args.layers, "mask_token_id": 2}
  if args.attention is not None:
    cfg["attention"] = args.attention
  return ModelConfig(**{**cfg, **extra})


def drafter_config(args, **extra):
  """A small random drafter with the target's vocabulary (2 layers, d_model 128)."""
  from paraflax.config import ModelConfig
  return ModelConfig(vocab_size=QWEN_05B["vocab_size"], d_model=128, n_layers=2, n_heads=2,
                     n_kv_heads=1, d_ff=384, max_seq_len=QWEN_05B["max_seq_len"],
                     tie_embeddings=True, **extra)


def random_model(cfg, seed: int = 0):
  """A Transformer with random weights, built in one compiled call (`step.init_params`)."""
  from flax import nnx
  from paraflax.training.step import init_params
  return nnx.merge(*init_params(cfg, seed))


def slot_widths(slots=SLOTS, tidar_k=TIDAR_K) -> list[tuple[int, str, int]]:
  """(query slots, mask kind, k) of each forward the slot-cost curve times: causal chunks of
  `slots`, TiDAR's k + k^2 for each of `tidar_k`."""
  return [(k, "causal", k) for k in slots] + [(k + k * k, "tidar", k) for k in tidar_k]


def slot_costs(model, cache_len: int, repeats: int, batch: int = 1, widths=None,
               progress: bool = True, inner: int = 1) -> list[dict]:
  """Seconds of a k-slot forward over a cache of `batch` rows holding `cache_len` tokens, each
  width of `widths` (default `slot_widths()`; the first is the one-token reference): best of
  `repeats` rounds, each round timing every width once (so a burst of load from other jobs
  on the machine hits all widths alike, not one). `inner` > 1 times a loop of that many
  forwards in one program and divides: device time without the per-call dispatch (a decode
  loop runs inside one program too; on an accelerator dispatch is as long as a forward)."""
  import jax
  import jax.numpy as jnp
  from tqdm import tqdm
  from paraflax import masks
  from paraflax.cache import init_cache
  from paraflax.decoding import state as st
  from paraflax.evaluation.overhead import best_of
  fwd = st.Forward.of(model)
  widths = widths or slot_widths()
  cache = init_cache(model.cfg, batch, cache_len + max(w for w, _, _ in widths))
  cache = cache.replace(lengths=jnp.full((batch,), cache_len, jnp.int32))
  def loop(f, tok, pos, mask, c):
    def body(i, acc):  # tokens vary with i, so XLA cannot hoist the forward out of the loop
      return acc + f(tok + i % 2, pos, mask, c)[0].max().astype(jnp.float32)
    return jax.lax.fori_loop(0, inner, body, jnp.float32(0))
  forward = jax.jit(loop)
  calls, rows = [], []
  bar = lambda it, desc: tqdm(it, desc=desc, file=sys.stdout, disable=not progress)
  for width, kind, k in bar(widths, "slot cost: compile"):
    mask = (masks.decode(cache.lengths, cache.slots, width) if kind == "causal"
            else masks.tidar_decode(cache.lengths, cache.slots, k))
    pos = cache.lengths[:, None] + jnp.arange(width)[None]
    tok = jnp.full((batch, width), 7, jnp.int32)
    calls.append(lambda tok=tok, pos=pos, mask=mask: forward(fwd, tok, pos, mask, cache))
    t0 = time.perf_counter()
    jax.block_until_ready(calls[-1]())
    rows.append({"slots": width, "mask": kind if kind == "causal" else f"tidar k={k}",
                 "compile_and_first_s": time.perf_counter() - t0})
  best = [float("inf")] * len(calls)
  for _ in bar(range(repeats), "slot cost: rounds"):
    best = [min(b, best_of(c, 1) / inner) for b, c in zip(best, calls)]
  one = best[0]
  return [{**r, "forward_ms": b * 1e3, "vs_one_token": b / one} for r, b in zip(rows, best)]


def decoder_table(args):
  """name -> (decoder, draft model kind or None), the bench's settings (`methods.py`)."""
  from paraflax import decoders
  from paraflax.evaluation.methods import mr_decoder
  return {"ar": (decoders.AR(), None),
          "jacobi": (decoders.Jacobi(block_size=16), None),
          "jacobi_mr": (mr_decoder(16), None),
          "prompt_lookup": (decoders.PromptLookup(max_ngram=3, num_tokens=8), None),
          "tidar": (decoders.TiDAR(block_size=8, beta=1.0), None),
          "speculative": (decoders.Speculative(4), "ar"),
          "deer": (decoders.DEER(8), "deer"),
          "any_order": (decoders.AnyOrder(), "two_stream"),
          "assd": (decoders.ASSD(5), "two_stream")}


def timed(fn, repeats: int) -> tuple[object, float, float]:
  """(result, first call seconds (compile included), best of `repeats` warm calls)."""
  import jax
  from paraflax.evaluation.overhead import best_of
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0, best_of(fn, repeats)


def run_generate(model, name, decoder, draft, prompt, args) -> dict:
  """One `pf.generate` run: tokens, forwards (prefill included), times."""
  import jax
  import paraflax as pf
  out, first, warm = timed(lambda: pf.generate(
      model, prompt, decoder=decoder, max_new_tokens=args.new_tokens, draft_model=draft,
      rng=jax.random.key(0)), args.repeats)
  out = jax.device_get(out)
  n = int(out.lengths[0])
  forwards = int(out.forwards[0] + out.prefill_forwards[0])
  return {"decoder": name, "tokens": out.tokens[0, :n].tolist(), "forwards": forwards,
          "draft_forwards": int(out.draft_forwards[0]), "tokens_per_forward": n / forwards,
          "first_s": first, "warm_s": warm}


def run_infill(model, name, decoder, prompt, args) -> dict:
  """One `pf.infill` run: the prompt then `--new-tokens` holes (left-to-right task)."""
  import jax
  import paraflax as pf
  from paraflax.decoding.lattice import HOLE
  canvas = np.concatenate([prompt, np.full((1, args.new_tokens), HOLE, np.int32)], 1)
  out, first, warm = timed(lambda: pf.infill(model, canvas, decoder=decoder,
                                             rng=jax.random.key(0)), args.repeats)
  out = jax.device_get(out)
  holes, calls = int(out.holes[0]), int(out.calls[0])
  return {"decoder": name, "tokens": out.tokens[0, prompt.shape[1]:].tolist(),
          "forwards": calls, "draft_forwards": 0, "tokens_per_forward": holes / calls,
          "first_s": first, "warm_s": warm}


def decode_all(args) -> dict:
  """Slot costs, then every decoder in `--decoders`; greedy equality against AR (generate
  decoders) or AnyOrder (ASSD: exact with respect to sequential any-order decoding)."""
  from tqdm import tqdm
  model = random_model(decode_config(args))
  report = {"layers": args.layers, "dtype": "float32", "cache_len": args.cache_len,
            "attention": model.cfg.attention}
  report["slot_cost"] = (slot_costs(model, args.cache_len, args.repeats)
                         if not args.skip_slots else [])
  prompt = np.random.default_rng(1).integers(3, QWEN_05B["vocab_size"],
                                             (1, args.prompt_len)).astype(np.int32)
  table, names = decoder_table(args), [d for d in args.decoders.split(",") if d]
  drafts, runs = {}, []
  for name in tqdm(names, desc="generate", file=sys.stdout):
    decoder, kind = table[name]
    if kind is not None and kind not in drafts:
      drafts[kind] = random_model(
          {"ar": lambda: drafter_config(args),
           "deer": lambda: drafter_config(args, mask_token_id=2, sep_token_id=3),
           "two_stream": lambda: decode_config(args, two_stream=True)}[kind](), seed=1)
    try:
      if kind == "two_stream":
        runs.append(run_infill(drafts[kind], name, decoder, prompt, args))
      else:
        runs.append(run_generate(model, name, decoder, drafts.get(kind), prompt, args))
    except Exception as e:  # report and go on: one decoder's failure is a finding
      runs.append({"decoder": name, "error": f"{type(e).__name__}: {e}"[:300]})
    print(json.dumps({k: v for k, v in runs[-1].items() if k != "tokens"}), flush=True)
  ref = {r["decoder"]: r.get("tokens") for r in runs}
  for r in runs:
    base = ref.get("any_order" if r["decoder"] in ("assd", "any_order") else "ar")
    r["equals_reference"] = None if base is None or "tokens" not in r else r["tokens"] == base
  report["generate"] = runs
  report["peak_rss_gib"] = peak_rss_gib()
  return report


# ---------------------------------------------------------------- driver

def child(args) -> None:
  """Run one part in this process and write its JSON to `--child-out`."""
  kind, _, name = args.child.partition(":")
  report = train_one(name, args) if kind == "train" else decode_all(args)
  Path(args.child_out).write_text(json.dumps(report, indent=1))


def spawn(part: str, out: Path) -> dict:
  """This script as a subprocess running `part` ("train:NAME" or "decode"); its report."""
  path = out / f"_{part.replace(':', '_')}.json"
  path.unlink(missing_ok=True)
  cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child", part,
         "--child-out", str(path)]
  t0 = time.perf_counter()
  rc = subprocess.run(cmd, cwd=ROOT).returncode
  if rc or not path.exists():
    return {"part": part, "error": f"subprocess exited {rc}", "wall_s": time.perf_counter() - t0}
  report = json.loads(path.read_text())
  path.unlink()
  return {**report, "wall_s": time.perf_counter() - t0}


def train_table(rows: list[dict]) -> str:
  lines = ["| objective | remat, scan | compile s | step s | loss | grad norm | params moved "
           "| XLA GiB | peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r or "skipped" in r:
      lines.append(f"| {r.get('objective', r.get('part'))} | {r.get('error') or r['skipped']} "
                   "|||||||")
      continue
    gib = f"{r['xla_total_gib']:.2f}"
    lines.append(f"| {r['objective']} | {r['remat']}, {r['scan_layers']} | {r['compile_s']:.1f} | "
                 f"{r['step_s']:.1f} | {r['loss']:.4f} | {r['grad_norm']:.3f} | "
                 f"{r['params_moved']} | {gib} | {r['peak_rss_gib']:.2f} |")
  return "\n".join(lines)


def decode_tables(d: dict) -> str:
  lines = ["| slots | mask | forward ms | vs one token |", "|---|---|---|---|"]
  lines += [f"| {r['slots']} | {r['mask']} | {r['forward_ms']:.1f} | {r['vs_one_token']:.2f}x |"
            for r in d["slot_cost"]]
  if not d["generate"]:
    return "\n".join(lines)
  lines += ["", "| decoder | tokens/forward | forwards | drafter forwards | first s (compile) "
            "| warm s | equals greedy reference |", "|---|---|---|---|---|---|---|"]
  for r in d["generate"]:
    if "error" in r:
      lines.append(f"| {r['decoder']} | error: {r['error']} ||||||")
      continue
    ref = "any_order" if r["decoder"] in ("assd", "any_order") else "ar"
    eq = {True: "yes", False: "NO", None: "-"}[r["equals_reference"]]
    lines.append(f"| {r['decoder']} | {r['tokens_per_forward']:.2f} | {r['forwards']} | "
                 f"{r['draft_forwards']} | {r['first_s']:.1f} | {r['warm_s']:.2f} | "
                 f"{eq} (vs {ref}) |")
  return "\n".join(lines)


def plot(slot_cost: list[dict], path: Path, layers: int) -> None:
  """The slot-cost curve: forward time relative to a one-token forward, against slots."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  for kind, style in (("causal", "o-"), ("tidar", "s")):
    pts = [r for r in slot_cost if r["mask"].startswith(kind)]
    ax.plot([r["slots"] for r in pts], [r["vs_one_token"] for r in pts], style,
            label="causal chunk" if kind == "causal" else "TiDAR k + k^2 (k = 4, 8)")
  ax.plot([16], [4.5], "x", color="gray", label="1.3M demo model, 16 slots (README)")
  ax.set(xscale="log", xlabel="query slots per forward", ylabel="time / one-token forward",
         title=f"Qwen2.5-0.5B shape ({layers} layers), float32, this CPU")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--objectives", default=",".join(CONFIGS),
                 help=f"comma-separated objectives to train one step (of {', '.join(CONFIGS)}; "
                      "empty: none)")
  p.add_argument("--decoders", default=",".join(DECODERS),
                 help=f"comma-separated decoders to run (of {', '.join(DECODERS)})")
  p.add_argument("--layers", type=int, default=24, help="n_layers of the model (Qwen: 24)")
  p.add_argument("--seq-len", type=int, default=1024, help="training data.seq_len")
  p.add_argument("--remat", choices=("auto", "none", "full", "save_matmuls"), default=None,
                 help="ModelConfig.remat for training (default: the config's, 'auto')")
  p.add_argument("--scan-layers", choices=("auto", "true", "false"), default=None,
                 help="ModelConfig.scan_layers for training (default: the config's, 'auto')")
  p.add_argument("--attention", default=None,
                 help="ModelConfig.attention, training and decoding (default: the config's)")
  p.add_argument("--max-gib", type=float, default=12.0,
                 help="do not run a step whose XLA memory analysis needs more than this")
  p.add_argument("--skip-decode", action="store_true", help="training only")
  p.add_argument("--skip-slots", action="store_true", help="no slot-cost curve")
  p.add_argument("--cache-len", type=int, default=1024,
                 help="filled cache slots of the slot-cost forwards")
  p.add_argument("--prompt-len", type=int, default=64, help="generate: prompt tokens")
  p.add_argument("--new-tokens", type=int, default=16, help="generate: new tokens")
  p.add_argument("--repeats", type=int, default=3,
                 help="slot cost and generate: best of this many warm calls")
  p.add_argument("--out", default="runs/real_size_smoke", help="where the JSON and PNG go")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  unknown = set(filter(None, args.objectives.split(","))) - set(CONFIGS)
  unknown |= set(filter(None, args.decoders.split(","))) - set(DECODERS)
  if unknown:
    p.error(f"unknown objective or decoder: {sorted(unknown)}")
  return args


def main(argv=None) -> int:
  args = parse(argv)
  if args.child:
    child(args)
    return 0
  out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  report = {"command": " ".join(["python", *sys.argv]), "model": {**QWEN_05B,
            "n_layers": args.layers}, "train": [], "decode": None}
  t0 = time.perf_counter()
  for name in filter(None, args.objectives.split(",")):  # one process each: a clean peak RSS
    report["train"].append(spawn(f"train:{name}", out))
    print(json.dumps({k: v for k, v in report["train"][-1].items() if k != "batch"}), flush=True)
  if not args.skip_decode:
    report["decode"] = spawn("decode", out)
  report["wall_s"] = time.perf_counter() - t0
  (out / "smoke.json").write_text(json.dumps(report, indent=1))
  if report["train"]:
    print("\n" + train_table(report["train"]))
  if report["decode"] and "error" not in report["decode"]:
    print("\n" + decode_tables(report["decode"]))
    if report["decode"]["slot_cost"]:
      plot(report["decode"]["slot_cost"], out / "slot_cost.png", args.layers)
  print(f"\nwrote {out / 'smoke.json'} ({report['wall_s'] / 60:.1f} min)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
