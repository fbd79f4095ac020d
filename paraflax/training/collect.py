"""Training stores built from a trained workdir's model on prompts from its training split:
Jacobi trajectories (Jacobi Forcing's data) and greedy teacher answers (the DEER drafters').

With `mesh` (as `TrainConfig.mesh`: a `MeshConfig`, `(data, fsdp, tensor)` sizes or a mapping;
or a `jax.sharding.Mesh` with `axis_rules`) the checkpoint is restored sharded onto it and each
batch's prompts are split over its data axes; multi-host, each process writes its own rows of
the store (`shares.py`)."""

from __future__ import annotations

import time

import jax

from paraflax import sharding
from paraflax.data.pipeline import prepare_stdlib
from paraflax.training import load_trained, teacher, trajectories


def _load(workdir, mesh, axis_rules):
  """(model on the resolved mesh, tokenizer, training tokens, resolved mesh)."""
  mesh = sharding.resolve_mesh(mesh, axis_rules)
  model, tok, train_cfg = load_trained(workdir, mesh=mesh)
  return model, tok, prepare_stdlib(train_cfg.data, tokenizer=tok).train_tokens, mesh


def _devices(mesh) -> dict:
  sizes = (1, 1, 1) if mesh is None else tuple(mesh.shape.values())
  return {"devices": 1 if mesh is None else mesh.size, "mesh": list(sizes),
          "processes": jax.process_count()}


def collect_trajectories(workdir, out, cfg: trajectories.CollectConfig, *, mesh=None,
                         axis_rules=None) -> dict:
  """`trajectories.collect` of a training workdir's model on prompts from its training split."""
  model, tok, tokens, mesh = _load(workdir, mesh, axis_rules)
  t0 = time.perf_counter()
  out = trajectories.collect(model, tok, tokens, out, cfg, source=str(workdir), mesh=mesh)
  seconds = time.perf_counter() - t0
  iters = trajectories.load(out).iterations
  return {"out": str(out), "examples": len(iters), "block_size": cfg.block_size,
          "mean_iterations_per_block": float(iters.mean()),
          "seconds_this_run": round(seconds, 1), **_devices(mesh)}


def teacher_data(workdir, out, cfg: teacher.TeacherConfig, *, mesh=None,
                 axis_rules=None) -> dict:
  """`teacher.collect` of a training workdir's model (the AR teacher) on prompts from its
  training split: the DEER drafters' training data. Returns a summary."""
  model, tok, tokens, mesh = _load(workdir, mesh, axis_rules)
  t0 = time.perf_counter()
  out = teacher.collect(model, tok, tokens, out, cfg, source=str(workdir), mesh=mesh)
  seconds = time.perf_counter() - t0
  store = teacher.load(out)
  return {"out": str(out), "examples": len(store.answers), "answer_len": cfg.answer_len,
          "prompt_tokens": int(store.prompt_lens.sum()), "answer_tokens": int(store.answers.size),
          "seconds_this_run": round(seconds, 1), **_devices(mesh)}
