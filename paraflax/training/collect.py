"""Training stores built from a trained workdir's model on prompts from its training split:
Jacobi trajectories (Jacobi Forcing's data) and greedy teacher answers (the DEER drafters')."""

from __future__ import annotations

import time

from paraflax.data.pipeline import prepare_stdlib
from paraflax.training import load_trained, teacher, trajectories


def collect_trajectories(workdir, out, cfg: trajectories.CollectConfig) -> dict:
  """`trajectories.collect` of a training workdir's model on prompts from its training split."""
  model, tok, train_cfg = load_trained(workdir)
  data = prepare_stdlib(train_cfg.data, tokenizer=tok)
  out = trajectories.collect(model, tok, data.train_tokens, out, cfg, source=str(workdir))
  iters = trajectories.load(out).iterations
  return {"out": str(out), "examples": len(iters), "block_size": cfg.block_size,
          "mean_iterations_per_block": float(iters.mean())}


def teacher_data(workdir, out, cfg: teacher.TeacherConfig) -> dict:
  """`teacher.collect` of a training workdir's model (the AR teacher) on prompts from its
  training split: the DEER drafters' training data. Returns a summary."""
  model, tok, train_cfg = load_trained(workdir)
  data = prepare_stdlib(train_cfg.data, tokenizer=tok)
  t0 = time.perf_counter()
  out = teacher.collect(model, tok, data.train_tokens, out, cfg, source=str(workdir))
  seconds = time.perf_counter() - t0
  store = teacher.load(out)
  return {"out": str(out), "examples": len(store.answers), "answer_len": cfg.answer_len,
          "prompt_tokens": int(store.prompt_lens.sum()), "answer_tokens": int(store.answers.size),
          "seconds_this_run": round(seconds, 1)}
