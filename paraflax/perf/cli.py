"""`paraflax perf {slots,decode,train,family,render}`: the flags of each part (named like its
plan's fields; unset flags keep the plan's defaults) and the run that writes its rows."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

from paraflax.model.run import RunControl
from paraflax.perf import decode, family, numerics, slots, train
from paraflax.perf.compile import calibrate
from paraflax.perf.compile import run as compile_run
from paraflax.perf.compile.targets import TARGETS
from paraflax.training.config.fields import field_types
from paraflax.training.config.overrides import parse

PARTS = {"numerics": (numerics.NumericsPlan, numerics.run, "the numerics of the device's own "
                      "paths: each objective's loss and gradient against the dense path, every "
                      "decoder's greedy tokens against AR's"),
         "slots": (slots.SlotsPlan, slots.run, "the slot cost c(k) of a k-slot decode forward"),
         "decode": (decode.DecodePlan, decode.run, "every decoder vs AR: ms/step against the "
                    "weight-read floor, tokens/forward, tokens/s, exactness"),
         "train": (train.TrainPlan, train.run, "one training step per objective: step time, "
                   "tokens/s, MFU, the run control used"),
         "family": (family.FamilyPlan, family.run, "the demo family trained from scratch at a "
                    "larger shape, then every bench method"),
         "compile": (compile_run.CompilePlan, compile_run.run, "every training step and decode "
                     "loop compiled for a GPU or TPU target on this host: kernels, host syncs, "
                     "memory, bytes (nothing runs)"),
         "calibrate": (calibrate.CalibratePlan, calibrate.run, "each program measured on a "
                       "device (traced) beside its compile row: kernels measured / compiled, "
                       "ms per kernel")}


def _ints(value: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in value.split(",") if v)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _names(value: str) -> tuple[str, ...]:
  return tuple(v for v in value.split(",") if v)


def _scan(value: str):
  """auto or a bool, in any case (Auto, true, FALSE, yes, no): bools as `--set` reads them."""
  if value.strip().lower() == "auto":
    return "auto"
  parsed = parse(value, field_types(RunControl)["scan_layers"])
  if not isinstance(parsed, bool):
    raise argparse.ArgumentTypeError(f"expected auto, true or false, got {value!r}")
  return parsed


# flag -> (type, help); a part takes the flags named like its plan's fields
FLAGS = {
    "target": (str, f"compile for: {', '.join(TARGETS)}, with a mesh after a colon "
                    "(tpu-v5e:2x4, h100:2)"),
    "hlo": (str, "a directory: write each program's optimised HLO text there"),
    "steps_per_iter": (int, "decode steps per loop iteration (default: the target's, 4)"),
    "shape": (str, "model shape: qwen2.5-0.5b, qwen2.5-7b, demo-21m (family), micro"),
    "layers": (int, "n_layers instead of the shape's"),
    "dtype": (str, "compute dtype (slots: bfloat16, decode: float32, train: bfloat16 with "
                   "float32 parameters)"),
    "attention": (str, "RunControl.attention (default: auto)"),
    "batches": (_ints, "batch sizes, comma-separated (default 1,8)"),
    "repeats": (int, "best of this many timings"),
    "cache_len": (int, "cache slots (default 2048)"),
    "slots": (_ints, "causal query-slot widths (default 1,4,16,64)"),
    "tidar_k": (_ints, "TiDAR's k + k^2 widths for these k (default 4,8; empty: none)"),
    "short_cache": (int, "also time --short-slots over this cache (default 256; 0: off)"),
    "short_slots": (_ints, "widths timed over the short cache (default 1,16,64)"),
    "inner": (int, "forwards per timed program (default 8; 1 on a CPU)"),
    "decoders": (_names, "decoders by CLI name (default: every generate decoder); compile: "
                         "NAME:N for N tokens per step (tidar:4)"),
    "prompt_len": (int, "prompt tokens (default 64)"),
    "new_tokens": (int, "new tokens per row (decode 512, family 128, compile 64)"),
    "profile": (str, "a directory: trace one call per decoder (train: one step per objective), "
                     "its summary in the row"),
    "profile_decoders": (_names, "the decoders --profile traces (default: every one)"),
    "measured": (str, "a device's perf JSON file (train / decode rows with traces)"),
    "compiled": (str, "the compile rows of its target (default docs/compile/h200.json)"),
    "reference": (str, "the reference attention path (default xla, the dense one)"),
    "loss_rtol": (float, "tolerance of the loss, relative (default 2e-2)"),
    "grad_rtol": (float, "tolerance of the gradient, relative L2 (default 5e-2)"),
    "objectives": (_names, "objectives (default: ar, jacobi_forcing, tidar, deer_stage1, "
                           "deer_stage2, asarm)"),
    "batch": (int, "training rows per batch (train: 1; family: each recipe's)"),
    "seq_len": (int, "training tokens per row, halved until the step fits (default 4096)"),
    "steps": (int, "train: timed steps (best of, default 5); family: every stage's steps"),
    "remat": (str, "RunControl.remat: auto, none, full, save_matmuls"),
    "scan_layers": (_scan, "RunControl.scan_layers: auto, true, false"),
    "max_gib": (float, "skip a step XLA needs more memory for (default: the device's)"),
    "out": (str, "a new directory to train the family in (default runs/perf_family)"),
    "stages": (_names, "stages to train (default: all six; each trains its dependencies)"),
    "examples": (int, "trajectories and teacher answers (default: the demo's)"),
    "prompts": (int, "bench prompts (default 16)"),
    "bench_batch": (int, "bench batch size (default 8)"),
    "ks": (_ints, "drafts / blocks of the swept bench methods (default 4,8,16)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
  sub = p.add_subparsers(dest="part", required=True)
  for part, (plan, _, help_) in PARTS.items():
    q = sub.add_parser(part, help=help_, description=help_)
    q.add_argument("--json", metavar="FILE", help="write the rows here as they are measured "
                   "(a file of an earlier run on this device kind: merged into)")
    q.add_argument("--md", metavar="FILE", help="write the rows' markdown tables here")
    for field in dataclasses.fields(plan):
      if field.name in FLAGS:
        kind, h = FLAGS[field.name]
        q.add_argument("--" + field.name.replace("_", "-"), type=kind, help=h)
    if part == "decode":
      q.add_argument("--transformers", action="store_true", default=None,
                     help="add transformers' generate on the same weights and device")
      q.add_argument("--cost", action="store_true", default=None,
                     help="add XLA's cost analysis of each decoder's step: bytes, FLOPs and "
                          "ops against the weight + cache floor (one more compile each)")
    if part == "family":
      q.add_argument("--no-mr", dest="mr", action="store_false", default=None,
                     help="leave out the Jacobi + MR rows")
  r = sub.add_parser("render", help="markdown tables of perf JSON files")
  r.add_argument("files", nargs="*", metavar="FILE.json")
  r.add_argument("--page", metavar="FILE.md", help="render the perf regions of this page "
                 "(`<!-- perf: FILE.json [kinds] -->` ... `<!-- /perf -->`) again, in place")


def plan_of(args):
  """The part's plan: its defaults, with the flags given."""
  plan = PARTS[args.part][0]
  return plan(**{f.name: getattr(args, f.name) for f in dataclasses.fields(plan)
                 if getattr(args, f.name, None) is not None})


def run(args, argv) -> int:
  """Run `args.part`; 1 when some of its measurements failed (the rest are written)."""
  from paraflax.perf.report import Report
  from paraflax.perf.pages import update_page
  from paraflax.perf.tables import render
  if args.part == "render":
    if not args.files and not args.page:
      raise ValueError("render what? give perf JSON files, or --page FILE.md")
    if args.page:
      page = Path(args.page)
      page.write_text(update_page(page.read_text(), page.parent))
      print(f"rendered the perf tables of {page}")
    if args.files:
      from paraflax.perf.rows import read_rows
      print(render([r for f in args.files for r in read_rows(f)]))
    return 0
  plan = plan_of(args)
  env = None
  if args.part == "compile":  # rows of the target, compiled on this host
    import jax

    from paraflax.perf.compile.targets import parse
    target = parse(plan.target)
    env = {"device": target.device_kind, "backend": target.platform, "jax": jax.__version__}
  if args.part == "calibrate" and plan.measured:  # rows of the device that measured
    from paraflax.perf.rows import read_rows
    first = read_rows(plan.measured)[0]
    env = {k: first[k] for k in ("device", "backend", "jax")}
  report = Report(args.json, args.md, "paraflax " + " ".join(map(shlex.quote, argv)), env)
  log = lambda s: print(s, flush=True)
  log(f"perf {args.part} on {report.env['device']} ({report.env['backend']}), "
      f"JAX {report.env['jax']}")
  errors = PARTS[args.part][1](plan, report.add, log)
  print("\n" + render(report.rows))
  for e in errors:
    print(f"paraflax perf {args.part}: failed: {e}")
  return 1 if errors else 0
