"""Training stores built from a model on prompts: Jacobi trajectories (Jacobi Forcing's data)
and greedy teacher answers (the DEER drafters').

The model is a training workdir (`workdir`) or a Hugging Face directory (`hf`). The prompts are
the records' of the JSONL files `data` (`store.record_prompts`: a prompt/response record's
prompt, a chat's messages before its last reply with the assistant's turn opened under the
model's chat template, a text record's first min..max_prompt_len tokens), or, for a workdir
without `data`, random windows of its training split (the stdlib corpus). A Hugging Face model
has no training split: it needs `data`.

With `mesh` (as `TrainConfig.mesh`: a `MeshConfig`, `(data, fsdp, tensor)` sizes or a mapping;
or a `jax.sharding.Mesh` with `axis_rules`) the model is placed sharded onto it and each
batch's prompts are split over its data axes; multi-host, each process writes its own rows of
the store (`shares.py`)."""

from __future__ import annotations

import argparse
import json
import time

import jax

from paraflax import destination
from paraflax.data.pipeline import prepare_stdlib
from paraflax.parallel import distributed, sharding
from paraflax.parallel.meshes import MeshConfig
from paraflax.paths import model_dirs, resolve_path
from paraflax.training import load_trained
from paraflax.training.config.overrides import parse
from paraflax.training.stores import store, teacher, trajectories

NO_SPLIT = "a Hugging Face model has no training split: pass --data FILE.jsonl"


def _record_prompts(model_dir, tok, data, cfg) -> store.Prompts:
  """The chosen prompts of the records of `data` (files or globs), encoded by `tok` and the
  chat template of `model_dir`."""
  from paraflax.data.chat import ChatTemplate
  from paraflax.data.jsonl import TextRecord, expand_paths, read_records
  from paraflax.data.records import RecordEncoder
  records = read_records(data)
  encoder = RecordEncoder(tok, ChatTemplate.of(model_dir))
  ids = [encoder.prompt_ids(r) for r in records]
  files = [resolve_path(str(f)) for f in expand_paths(data)]
  return store.record_prompts(ids, cfg, prefix=[isinstance(r, TextRecord) for r in records],
                              meta={"data": files})


def _load(workdir, mesh, axis_rules, cfg, hf=None, data=None):
  """(model, tokenizer, prompts: a token stream or `store.Prompts`, resolved mesh, model dir)."""
  workdir, hf = model_dirs(workdir, hf)
  if hf and not data:
    raise ValueError(NO_SPLIT)
  mesh = sharding.resolve_mesh(mesh, axis_rules)
  if hf:
    from paraflax.hf import load_hf, load_hf_tokenizer
    model, tok = load_hf(hf), load_hf_tokenizer(hf)  # placed on the mesh by `collect`
  else:
    model, tok, train_cfg = load_trained(workdir, mesh=mesh)
  if data:
    return model, tok, _record_prompts(hf or workdir, tok, data, cfg), mesh, hf or workdir
  return (model, tok, prepare_stdlib(train_cfg.data, tokenizer=tok).train_tokens, mesh,
          workdir)


def _devices(mesh) -> dict:
  sizes = (1, 1, 1) if mesh is None else tuple(mesh.shape.values())
  return {"devices": 1 if mesh is None else mesh.size, "mesh": list(sizes),
          "processes": jax.process_count()}


def _counts(prompts) -> dict:
  return prompts.counts if isinstance(prompts, store.Prompts) else {}


def collect_trajectories(workdir, out, cfg: trajectories.CollectConfig, *, mesh=None,
                         axis_rules=None, hf=None, data=None) -> dict:
  """`trajectories.collect` of a model (a training workdir, or an HF directory `hf`) on the
  prompts of the JSONL records `data`, or of a workdir's training split. Returns a summary."""
  destination.check_store_dir(out, "trajectory store")  # before the model loads
  model, tok, prompts, mesh, source = _load(workdir, mesh, axis_rules, cfg, hf, data)
  t0 = time.perf_counter()
  out = trajectories.collect(model, tok, prompts, out, cfg, source=str(source), mesh=mesh)
  seconds = time.perf_counter() - t0
  iters = trajectories.load(out).iterations
  return {"out": str(out), "examples": len(iters), "block_size": cfg.block_size,
          "mean_iterations_per_block": float(iters.mean()), **_counts(prompts),
          "seconds_this_run": round(seconds, 1), **_devices(mesh)}


def teacher_data(workdir, out, cfg: teacher.TeacherConfig, *, mesh=None, axis_rules=None,
                 hf=None, data=None) -> dict:
  """`teacher.collect` of a model (the AR teacher: a training workdir, or an HF directory `hf`)
  on the prompts of the JSONL records `data`, or of a workdir's training split: the DEER
  drafters' training data. Returns a summary."""
  destination.check_store_dir(out, "teacher store")  # before the model loads
  model, tok, prompts, mesh, source = _load(workdir, mesh, axis_rules, cfg, hf, data)
  t0 = time.perf_counter()
  out = teacher.collect(model, tok, prompts, out, cfg, source=str(source), mesh=mesh)
  seconds = time.perf_counter() - t0
  store_ = teacher.load(out)
  return {"out": str(out), "examples": len(store_.answers), "answer_len": cfg.answer_len,
          "prompt_tokens": int(store_.prompt_lens.sum()),
          "answer_tokens": int(store_.answers.size), **_counts(prompts),
          "seconds_this_run": round(seconds, 1), **_devices(mesh)}


def mesh_flag(value: str) -> MeshConfig:
  """`--mesh 1,8,1`: a mesh spec as `train --set mesh=...` takes it (sizes, -1 = the rest)."""
  try:
    return MeshConfig.of(parse(value, object))
  except (ValueError, TypeError) as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def add_source_arguments(q: argparse.ArgumentParser, what: str) -> None:
  """The model and prompt flags of the commands that fill a store."""
  src = q.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help=f"{what}: a training workdir")
  src.add_argument("--hf", metavar="DIR", help=f"{what}: a local Hugging Face checkpoint "
                   "directory (needs --data)")
  q.add_argument("--data", action="append", metavar="FILE.jsonl", help="prompts: the JSONL "
                 "records' (a prompt, a chat's messages before its last reply, a text's first "
                 "min..max-prompt-len tokens; longer prompts keep their last max-prompt-len, "
                 "shorter than min-prompt-len are skipped); files or globs, repeatable "
                 "(default: random windows of the workdir's training split)")


def add_mesh_arguments(q: argparse.ArgumentParser) -> None:
  """The mesh and multi-host flags of the commands that fill a store."""
  q.add_argument("--mesh", type=mesh_flag, default=None, metavar="DATA,FSDP,TENSOR",
                 help="run on a device mesh as `train --set mesh=...`, e.g. 1,8,1 (-1: the "
                 "rest): the model sharded, prompts split over data x fsdp (default: one device)")
  distributed.add_arguments(q)


def main(args: argparse.Namespace, cfg, fill) -> None:
  """`paraflax collect-trajectories` / `teacher-data`: `fill` (`collect_trajectories` or
  `teacher_data`) with `cfg` as the flags say, after the multi-host start-up; its summary
  printed as JSON once (by process 0)."""
  distributed.initialize_from_args(args)  # before any other JAX work
  summary = fill(args.workdir, args.out, cfg, mesh=args.mesh, hf=args.hf, data=args.data)
  if jax.process_index() == 0:  # one summary per run, not per host
    print(json.dumps(summary))
