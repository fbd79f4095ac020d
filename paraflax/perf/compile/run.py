"""`paraflax perf compile --target T`: every objective's training step and every generate
decoder's loop (and its prefill) compiled for a GPU or TPU target on this host, one row each:
kernels per step and their mix, host synchronisations, XLA's memory analysis against the
target's memory, bytes and FLOPs per step, the compile time (`rows.REQUIRED["compile"]`).

A training step is `perf train`'s recipe at the shape (compute `dtype`, float32 parameters),
`batch` x `seq_len` tokens, FSDP over the target's chips. A decode row is one step of the
compiled `while` loop (its body and condition over its steps per iteration) for `batch` rows
over a `cache_len`-slot cache (prompt `cache_len - new_tokens`), rows split over the chips;
its prefill row is the rest of the same program (everything outside the loop). On a mesh,
kernels, bytes, FLOPs, memory and the floor are one device's (the partitioned program); on a
TPU, bytes are HBM's (`hbm`). The run control is "auto" unless given, and resolves for the
target's platform (`RunControl.platform`), never this host's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from paraflax import methods
from paraflax.perf.compile import costs, kernels, programs, targets
from paraflax.perf.train import RECIPES

DRAFT_SCOPES = ("target", "drafter")  # `Forward.scope` of the decode loop's two models


@dataclasses.dataclass(frozen=True)
class CompilePlan:
  target: str = "h200"
  shape: str = "qwen2.5-0.5b"
  layers: int | None = None
  dtype: str = "bfloat16"
  objectives: tuple = tuple(RECIPES)
  decoders: tuple = tuple(methods.names())
  batches: tuple = (1, 8)  # decode rows
  batch: int = 1  # training rows per step
  seq_len: int = 4096
  cache_len: int = 2048
  new_tokens: int = 64
  steps_per_iter: int | None = None  # decode steps per loop iteration (None: the target's)
  attention: str | None = None  # run control; None: "auto"
  remat: str | None = None
  scan_layers: bool | str | None = None
  hlo: str | None = None  # a directory: each program's optimised HLO text


def run_control(plan: CompilePlan) -> dict:
  """The run control fields the plan sets (the others stay "auto")."""
  return {k: getattr(plan, k) for k in ("attention", "remat", "scan_layers")
          if getattr(plan, k) is not None}


def measure(text: str, target: targets.Target, *, body: str | None = None, per: int = 1,
            skip: frozenset = frozenset()) -> dict:
  """The row fields of one program's text: the whole entry, or (`body`) one run of a while's
  body and condition divided by `per` (a decode loop's steps per iteration); `skip` leaves
  instructions of the entry out (the prefill: everything but the loop)."""
  program = kernels.Program(text, target.platform, DRAFT_SCOPES)
  cost = costs.Costs(program)
  if body is None:
    count, c = program.count(skip=skip), cost.of()
    if skip:  # the left-out instructions are whiles: take their costs out
      loops = [i for i in program.comps[program.entry] if i.name in skip]
      for ins in loops:
        for name in (ins.attribute("body"), ins.attribute("condition")):
          c = c - cost.of(name.lstrip("%"))
  else:
    cond = next(i.attribute("condition").lstrip("%") for i in program.comps[program.entry]
                if i.op == "while" and i.attribute("body").lstrip("%") == body)
    count = kernels.Count()
    for name in (body, cond):
      count.add(program.count(name), 1 / per)
    count.syncs += (target.platform == "gpu") / per  # the loop's predicate, every iteration
    c = {k: (cost.of(body)[k] + cost.of(cond)[k]) / per for k in ("bytes", "flops", "uncosted")}
  return {"kernels_per_step": count.kernels, "kernel_mix": dict(count.mix.most_common()),
          "host_syncs_per_step": count.syncs, "bytes_per_step": c.get("bytes", 0.0),
          "flops_per_step": c.get("flops", 0.0),
          "uncosted_custom_calls": c.get("uncosted", 0),
          **({"kernels_by_scope": dict(count.scopes)} if count.scopes else {})}


def memory(compiled: programs.Compiled, target: targets.Target) -> dict:
  m = compiled.memory
  return {"arguments": m.get("argument_bytes"), "outputs": m.get("output_bytes"),
          "temporaries": m.get("temp_bytes"), "aliased": m.get("alias_bytes"),
          "total": m.get("total_bytes"), "capacity": target.capacity}


def save_hlo(plan: CompilePlan, name: str, text: str) -> None:
  """`text` as `<target>_<name>[_<run control given>].hlo.txt` under `plan.hlo`, if given."""
  if plan.hlo:
    given = "-".join(str(v) for v in run_control(plan).values())
    path = Path(plan.hlo) / (f"{plan.target.replace(':', '_')}_{name}"
                             f"{'_' + given if given else ''}.hlo.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def train_rows(plan: CompilePlan, target: targets.Target, head: dict, add, log, errors):
  from paraflax.perf.train import TrainPlan, recipe
  from paraflax.perf.train import run_control as resolved
  from paraflax.training.config.train import apply_overrides
  from paraflax.training.run import flops
  train_plan = TrainPlan(shape=plan.shape, layers=plan.layers, dtype=plan.dtype,
                         batch=plan.batch, **run_control(plan))
  for name in plan.objectives:
    try:
      cfg = apply_overrides(recipe(name, train_plan, plan.seq_len),
                            {"run.platform": target.platform})
      compiled, cfg = programs.train_step(cfg, target)
      save_hlo(plan, f"train_{name}_{plan.batch}x{plan.seq_len}", compiled.text)
      row = {**head, "program": "train", "objective": name, "batch": plan.batch,
             "seq_len": plan.seq_len, "defaults": not run_control(plan),
             "run_control": resolved(cfg),
             **measure(compiled.text, target), "memory": memory(compiled, target),
             "fit": list(compiled.fit),
             "model_flops_per_step": flops.train_flops(cfg.model, cfg.objective, plan.batch,
                                                       plan.seq_len, cfg.objective_args),
             "compile_s": round(compiled.compile_s, 1)}
    except Exception as e:  # one program's failure is a finding; the others still compile
      errors.append(f"compile: train {name}: {type(e).__name__}: {e}"[:400])
      log(errors[-1])
      continue
    add(row)
    log(f"[compile {plan.target}] train {name}: {row['kernels_per_step']:,.0f} kernels, "
        f"{row['host_syncs_per_step']:g} host syncs, {row['memory']['total'] / 2**30:.1f} GiB, "
        f"{row['compile_s']:.0f} s")


def decode_rows(plan: CompilePlan, target: targets.Target, head: dict, add, log, errors):
  from paraflax.decoding import core
  from flax import nnx

  from paraflax.decoding.cost import bytes_at, cache_bytes, cache_shape, loop_body
  from paraflax.hlo import computations
  from paraflax.model.cache import cache_slots
  from paraflax.model.run import RunControl
  from paraflax.perf.decode import drafter_config
  from paraflax.perf.shapes import model_config
  run = RunControl(**run_control(plan), platform=target.platform)
  cfg = model_config(plan.shape, plan.dtype, plan.layers)
  model = programs.abstract_model(cfg, run)
  prompt = plan.cache_len - plan.new_tokens
  for b in plan.batches:
    for asked in plan.decoders:
      name, n = _decoder_entry(asked)
      m = methods.spec(name)
      try:
        decoder = m.make(n)
        draft = None if m.drafter is None else programs.abstract_model(
            drafter_config(m.drafter, cfg), run)
        per = core.resolve_steps_per_iter(plan.steps_per_iter, decoder, plan.new_tokens,
                                          target.platform)
        compiled = programs.decode_loop(model, decoder, b, prompt, plan.new_tokens, per, target,
                                        draft)
        save_hlo(plan, f"decode_{asked.replace(':', '')}_{b}x{plan.cache_len}_{per}steps",
                 compiled.text)
        comps, entry = computations(compiled.text)
        slots = cache_slots(decoder.cache_capacity(prompt, plan.new_tokens), target.platform)
        local = b // target.chips if b % target.chips == 0 else b  # rows split over the chips
        body = loop_body(comps, entry, cache_shape(cfg, local, slots))
        loop = next(i.name for i in comps[entry] if i.op == "while"
                    and i.attribute("body").lstrip("%") == body)
        common = {**head, "decoder": name, "settings": m.describe(n), "batch": b,
                  "defaults": not run_control(plan) and plan.steps_per_iter is None,
                  "memory": memory(compiled, target),
                  "compile_s": round(compiled.compile_s, 1)}
        step = measure(compiled.text, target, body=body, per=per)
        drafts = decoder.draft_forwards_per_step  # the floor reads a drafter's weights each
        weights = bytes_at(nnx.state(model), cfg.compute_dtype) + (
            0 if draft is None else drafts * bytes_at(nnx.state(draft), draft.cfg.compute_dtype))
        kv = cache_bytes(cfg, local, plan.cache_len) + (  # one device's rows
            0 if draft is None else cache_bytes(draft.cfg, local, plan.cache_len))
        scopes = step.pop("kernels_by_scope", {})
        forwards = {"kernels_per_target_forward": scopes.get("target", step["kernels_per_step"]),
                    **({"kernels_per_drafter_forward": scopes.get("drafter", 0.0) / drafts}
                       if draft is not None else {})}
        add({**common, "program": "decode", "cache_len": plan.cache_len,
             "run_control": {**dataclasses.asdict(run), "steps_per_iter": per,
                             "attention": run.attention_for(cfg, 1, cached=True)},
             **step, **forwards, "floor_bytes": weights + kv,
             "bytes_per_floor": step["bytes_per_step"] / (weights + kv)})
        if name == "ar":
          prefill = measure(compiled.text, target, skip=frozenset({loop}))
          prefill.pop("kernels_by_scope", None)
          add({**common, "program": "prefill", "seq_len": prompt,
               "run_control": {**dataclasses.asdict(run),
                               "attention": run.attention_for(cfg, prompt)}, **prefill})
      except Exception as e:  # one program's failure is a finding; the others still compile
        errors.append(f"compile: decode {asked} batch {b}: {type(e).__name__}: {e}"[:400])
        log(errors[-1])
        continue
      log(f"[compile {plan.target}] decode {asked} batch {b}: "
          f"{step['kernels_per_step']:,.0f} kernels/step, {step['host_syncs_per_step']:g} host "
          f"syncs/step, {step['bytes_per_step'] / (weights + kv):.2f}x floor bytes, "
          f"{compiled.compile_s:.0f} s")


def _decoder_entry(entry: str) -> tuple[str, int | None]:
  """`name` or `name:n` (n tokens per step, e.g. `tidar:4`) -> (name, n or None)."""
  name, _, n = entry.partition(":")
  if n and not n.isdigit():
    raise ValueError(f"decoder {entry!r}: expected NAME or NAME:N with N tokens per step")
  return name, int(n) if n else None


def run(plan: CompilePlan, add, log) -> list[str]:
  """Training rows, then decode and prefill rows, for the plan's target (`add` takes each as it
  is compiled); the errors of the programs that failed (the others still compile)."""
  import jax
  target = targets.parse(plan.target)
  unknown = [o for o in plan.objectives if o not in RECIPES]
  if unknown:
    raise ValueError(f"unknown objective {unknown[0]!r}: pick from {', '.join(RECIPES)}")
  for asked in plan.decoders:
    methods.spec(_decoder_entry(asked)[0])
  targets.devices(target)  # a missing plugin: one line before any work
  head = {"kind": "compile", "compiled_only": True, "target": plan.target, "shape": plan.shape,
          "dtype": plan.dtype, "layers": plan.layers, "jax": jax.__version__}
  errors = []
  train_rows(plan, target, head, add, log, errors)
  decode_rows(plan, target, head, add, log, errors)
  return errors
