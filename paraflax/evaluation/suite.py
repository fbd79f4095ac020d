"""What `paraflax bench` reports: every method's row on HumanEval prompts, quality per weights
(HumanEval pass@1; held-out loss when other weights than the base run), the AS-ARM's
any-subset table, and the JSON of DESIGN.md §6 with its plots."""

from __future__ import annotations

import dataclasses

import numpy as np

from paraflax.data.humaneval import load_humaneval
from paraflax.data.prompts import prompt_ids, read_prompts
from paraflax.evaluation import bench
from paraflax.evaluation import infill_bench as ib
from paraflax.evaluation.humaneval import greedy_pass_at_1, humaneval_prompts
from paraflax.evaluation.methods import bench_methods, fitting, infill_methods
from paraflax.evaluation.quality import (
  heldout_batches,
  heldout_loss,
  heldout_metrics,
  records_batches,
)
from paraflax.loading import load_drafter, load_model, load_related


@dataclasses.dataclass(frozen=True)
class Models:
  """The base model (`workdir` or `hf`) and runs made with its tokenizer (None: skipped)."""
  workdir: str | None = None  # a training workdir or a `paraflax convert` output
  hf: str | None = None  # a local Hugging Face checkpoint directory
  jf_workdir: str | None = None  # Jacobi Forcing distilled from the base: its rows
  tidar_workdir: str | None = None  # TiDAR trained on from the base: tidar_k4/8/16
  deer_workdir: str | None = None  # a DEER diffusion drafter: deer_k4/8/16
  ar_drafter_workdir: str | None = None  # a small AR drafter: spec_ar_k4/8/16
  asarm_workdir: str | None = None  # an AS-ARM: the any-subset table


@dataclasses.dataclass(frozen=True)
class Settings:
  prompts: int = 8  # HumanEval prompts
  max_new_tokens: int = 64
  max_prompt_tokens: int = 192
  batch_size: int = 4
  infill_windows: int = 64  # held-out windows of the AS-ARM's 95%-masking generation task
  infill_length: int = 128  # tokens per such window
  json: str | None = None  # per-method results; the plots go beside it
  prompts_file: str | None = None  # the user's prompts (JSONL: prompt or messages) for HumanEval's
  eval_data: str | None = None  # the user's JSONL: held-out loss of every weights on it


OTHER_WEIGHTS = {"jf": "jf_workdir", "tidar": "tidar_workdir"}  # weights name -> Models field
DRAFTERS = {"deer": "deer_workdir", "ar_drafter": "ar_drafter_workdir"}  # drafter -> field


def _flag(field: str) -> str:
  return "--" + field.replace("_", "-")


def asarm_rows(asarm, judge, tok, s: Settings) -> list:
  """Sequential vs ASSD (self, n-gram; k = 5) of the AS-ARM on 95%-masked held-out stdlib
  windows (sampled, gen-PPL under `judge` and entropy) and on HumanEval single-line infilling
  (greedy, pass@1)."""
  batches = heldout_batches(tok, batches=-(-s.infill_windows // 8), batch_size=8)
  windows = np.concatenate([b["tokens"] for b in batches])
  windows = windows[:s.infill_windows, :s.infill_length]
  rows = ib.run_infill_bench(asarm, infill_methods(greedy=False), "generate",
                             ib.masked_windows(windows, 0.95), judge=judge,
                             batch_size=s.batch_size)
  tasks = ib.single_line_tasks(tok.encode, load_humaneval()[:s.prompts],
                               min(256, asarm.cfg.max_seq_len), tok.eos_id)
  rows += ib.run_infill_bench(
      asarm, infill_methods(greedy=True), "line", np.stack([t.canvas for t in tasks]),
      line_tasks=tasks, decode=tok.decode, batch_size=s.batch_size)
  return rows


def run(models: Models, s: Settings, log=print) -> list:
  """Bench every method the models allow, `log` the tables and quality lines, write
  `s.json` (and the plots) when set; returns the rows."""
  model, tok, encode = load_model(models.workdir, models.hf)
  others = {name: load_related(getattr(models, f), tok, model.cfg.vocab_size, _flag(f))
            for name, f in OTHER_WEIGHTS.items() if getattr(models, f)}
  drafters = {name: load_drafter(getattr(models, f), None, tok, model)  # (drafter, vocab)
              for name, f in DRAFTERS.items() if getattr(models, f)}
  max_prompt = min(s.max_prompt_tokens, model.cfg.max_seq_len - s.max_new_tokens)
  if s.prompts_file:  # the user's: the first `s.prompts` records, their last max_prompt tokens
    texts = read_prompts(prompts_file=s.prompts_file)[:s.prompts]
    prompts = [prompt_ids(p, False, tok, encode, models.workdir or models.hf)[-max_prompt:]
               for p in texts]
  else:
    prompts = humaneval_prompts(encode, s.prompts, max_prompt)
  methods, skipped = fitting(bench_methods(others, drafters), model)
  for line in skipped:
    log(line)
  rows = bench.run_bench(model, prompts, methods,
                         max_new_tokens=s.max_new_tokens, batch_size=s.batch_size,
                         eos_id=tok.eos_ids)
  log(bench.format_table(rows))
  weights = {"base": model, **others}
  quality = {w: {} for w in weights}
  if not s.prompts_file:  # HumanEval's tests judge HumanEval's prompts only
    for w, m in weights.items():
      quality[w]["humaneval_pass_at_1"] = greedy_pass_at_1(m, tok, prompts, s.max_new_tokens)
    log(f"HumanEval pass@1 (greedy AR of each weights = every exact method's output; "
        f"{len(prompts)} problems, {s.max_new_tokens} tokens): " + ", ".join(
            f"{w} {q['humaneval_pass_at_1']:.2f}" for w, q in quality.items()))
  if others:  # other weights than the base: how much did quality move?
    val = heldout_batches(tok)
    for w, m in weights.items():
      quality[w]["heldout_loss"] = heldout_loss(m, val)
    if "tidar" in others:  # the diffusion mode's own loss, next to its AR mode's
      quality["tidar"]["heldout_diffusion_loss"] = heldout_metrics(
          others["tidar"], val, "tidar", {"block_size": 8})["diff_loss"]
    log("held-out stdlib loss (nats/token, AR mode): " + ", ".join(
        f"{w} {q['heldout_loss']:.3f}" for w, q in quality.items())
        + ("" if "tidar" not in quality else
           f"; tidar diffusion mode (block 8) {quality['tidar']['heldout_diffusion_loss']:.3f}"))
  if s.eval_data:  # the user's data: loss on its responses, as training counts it
    val = records_batches(tok, s.eval_data, models.workdir or models.hf,
                          seq_len=min(256, model.cfg.max_seq_len))
    for w, m in weights.items():
      quality[w]["eval_data_loss"] = heldout_loss(m, val)
    log(f"loss on {s.eval_data} (nats/token, AR mode, {sum(b['loss_mask'][:, 1:].sum() for b in val)}"
        " target tokens): " + ", ".join(f"{w} {q['eval_data_loss']:.3f}" for w, q in quality.items()))
  infill_rows = []
  if models.asarm_workdir:
    asarm = load_related(models.asarm_workdir, tok, model.cfg.vocab_size, "--asarm-workdir")
    infill_rows = asarm_rows(asarm, model, tok, s)
    log("\nAS-ARM any-subset decoding (judge for gen-PPL: the base model; speedup vs "
        "the AS-ARM's sequential sampler):")
    log(ib.format_infill_table(infill_rows))
  if s.json:
    path = bench.write_json(list(rows) + infill_rows, s.json, by_weights=quality)
    log(f"wrote {path}")
    for png in bench.plot(rows, path.parent):
      log(f"wrote {png}")
  return list(rows) + infill_rows
