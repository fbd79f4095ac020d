"""`paraflax demo`: the demo family's models (`training/family.py`: shipped snapshots copied
from the clone's `checkpoints/`, or trained), a few completions, then the bench of them all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from paraflax import paths
from paraflax.decoding.generate import generate
from paraflax.evaluation import suite
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.loading import load_model
from paraflax.training.config.recipes import RECIPES
from paraflax.training.family import JACOBI_FORCING, Build, ensure

SHIPPED = "checkpoints"  # the clone's shipped snapshots, relative to where the demo runs


def run(models: suite.Models, s: suite.Settings, *, cache: Path = paths.CACHE,
        shipped: str | Path | None = None, quick=False, retrain=False, ship=False, steps=None,
        log=print) -> list:
  """The tiny models (copied from `shipped`, default `SHIPPED`, else trained), a few
  completions, then the bench. `models.hf` benches a local Hugging Face checkpoint instead;
  `quick` benches 4 prompts x 32 tokens. Runs given in `models` replace the stages' own; the
  JSON goes to the cache by default."""
  if quick:
    s = dataclasses.replace(s, prompts=min(s.prompts, 4), max_new_tokens=min(s.max_new_tokens, 32))
  s = dataclasses.replace(s, json=s.json or str(cache / "demo" / "bench.json"))
  if models.hf:
    log(f"\n[demo] bench of the Hugging Face checkpoint {models.hf} on HumanEval prompts:")
    return suite.run(dataclasses.replace(models, workdir=None), s, log=log)
  shipped = Path(shipped or SHIPPED)
  if not retrain and not shipped.is_dir():
    log(f"[demo] no shipped models in {shipped} (run from the repository's root, or give "
        "--shipped DIR): training them")
  build = Build(cache=cache / "demo", configs=RECIPES, shipped=shipped, retrain=retrain,
                ship=ship, steps=steps)
  stage = lambda given, name: given or str(ensure(name, build))
  models = dataclasses.replace(
      models, workdir=str(ensure("tiny_ar", build)),
      jf_workdir=stage(models.jf_workdir, JACOBI_FORCING),
      tidar_workdir=stage(models.tidar_workdir, "tidar_continual"),
      deer_workdir=stage(models.deer_workdir, "deer_drafter"),
      ar_drafter_workdir=stage(models.ar_drafter_workdir, "ar_drafter"),
      asarm_workdir=stage(models.asarm_workdir, "asarm"))
  model, tok, _ = load_model(models.workdir)
  log("\n[demo] HumanEval completions (greedy AR):")
  prompts = humaneval_prompts(tok.encode, 3, 192)
  out = jax.device_get(generate(model, prompts, max_new_tokens=48, eos_id=tok.eos_id))
  for p, row, n in zip(prompts, out.tokens, out.lengths):
    log("-" * 60 + "\n" + tok.decode(p[-60:]) + "\033[1m" + tok.decode(row[:n].tolist())
        + "\033[0m")
  log("\n[demo] bench on HumanEval prompts:")
  return suite.run(models, s, log=log)
