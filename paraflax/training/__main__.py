"""`python -m paraflax.training --config tiny_ar --workdir DIR [--steps N]`
`[--hf HF_DIR] [--data FILE.jsonl ...] [--set NAME=VALUE ...] [--profile-steps A:B]`.

Trains (resuming from DIR's latest checkpoint if any) and prints the summary as JSON.
With `--dry-run` it trains nothing and writes nothing: it compiles one step of the config
with abstract shapes and prints XLA's memory report and the step's FLOPs as JSON (`run/dry_run.py`).
`--profile-steps A:B` writes a jax.profiler trace of steps A..B-1 into DIR/profile.
With `--hf DIR` the config is a recipe retargeted at a Hugging Face model (`config/from_hf.py`);
`--data FILE.jsonl` trains on the user's JSON Lines (data source "jsonl").
Multi-host: run it on every host with --coordinator/--num-processes/--process-id (or the
PARAFLAX_* environment, see `paraflax.parallel.distributed`) and a mesh, e.g. `--set mesh=(-1,1,1)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

from paraflax.parallel import (
  distributed,  # light: `paraflax train` builds its flags from this module
)


def parse_overrides(items: list[str]) -> dict[str, str]:
  """["data.cache_dir=/tmp/c", "optim.peak_lr=1e-3"] -> {dotted name: value string}."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"--set expects NAME=VALUE (e.g. optim.peak_lr=1e-3), got {item!r}")
    out[key.strip()] = value
  return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of `paraflax train` and of this module."""
  parser.add_argument("--config", required=True, help="a recipe name (tiny_ar, hf/sft, ...: "
                      "paraflax/recipes/) or a Python file exposing get_config()")
  parser.add_argument("--workdir", required=True, help="run directory (resumed if it exists)")
  parser.add_argument("--steps", type=int, default=None, help="override TrainConfig.steps")
  parser.add_argument("--max-steps", type=int, default=None,
                      help="stop at this step without changing the schedule")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="NAME=VALUE", help="dotted config override, repeatable (e.g. "
                      "optim.peak_lr=1e-3, mesh=(2,2,2))")
  parser.add_argument("--hf", metavar="DIR", default=None, help="start from this Hugging Face "
                      "directory (or a workdir trained from one, e.g. DEER Stage I): its "
                      "architecture, weights and tokenizer (the config gives the "
                      "method, optimiser and loop; method tokens <mask>/<sep> are added when "
                      "the recipe needs them: data.mask_token/data.sep_token pick others)")
  parser.add_argument("--data", metavar="FILE.jsonl", action="append", default=[],
                      help="train on these JSON Lines records ({\"text\"}, {\"prompt\", "
                      "\"response\"} or chat {\"messages\"}; a file, glob or directory), "
                      "repeatable; without --hf the tokenizer is a trained BPE, or "
                      "data.tokenizer's")
  parser.add_argument("--dry-run", action="store_true", help="compile one step with abstract "
                      "shapes (no weights, no data, nothing written) and print its memory as "
                      "JSON: argument_bytes, temp_bytes, ... per device")
  parser.add_argument("--profile-steps", metavar="A:B", default=None,
                      help="write a jax.profiler trace of steps A..B-1 (0-based) into "
                      "WORKDIR/profile (XProf / TensorBoard, Perfetto)")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  distributed.add_arguments(parser)


def run(args: argparse.Namespace) -> dict:
  """Train (or, with --dry-run, compile one step) as the parsed flags say; the summary."""
  from paraflax.training.run.profile import parse_steps
  window = None if args.profile_steps is None else parse_steps(args.profile_steps)
  distributed.initialize_from_args(args)  # no-op unless multi-host flags or env are set
  cfg = config_from_args(args)
  if args.dry_run:
    from paraflax.training.run.dry_run import dry_run
    return dry_run(cfg)
  from paraflax.training.run.trainer import train
  return train(cfg, args.workdir, progress=not args.no_progress, max_steps=args.max_steps,
               profile_steps=window)


def config_from_args(args: argparse.Namespace):
  """The run's TrainConfig: the config file retargeted at --hf and --data
  (`config/from_hf.py`), with each --set applied once: before retargeting (method tokens, run
  control, ...: what it reads from the recipe), or after it for what it derives (with --hf the
  architecture, `model.*`; with --data the jsonl source's arguments, `data_source_args.*`);
  then --steps."""
  from paraflax.training.config.from_hf import from_hf, with_data
  from paraflax.training.config.train import apply_overrides, load_config
  overrides = parse_overrides(args.overrides)
  derived = tuple(p for p, given in (("model.", args.hf), ("data_source_args.", args.data))
                  if given)
  cfg = apply_overrides(load_config(args.config),
                        {k: v for k, v in overrides.items() if not k.startswith(derived)})
  if args.hf:
    cfg = from_hf(cfg, args.hf, args.data)
  elif args.data:
    cfg = with_data(cfg, args.data)
  cfg = apply_overrides(cfg, {k: v for k, v in overrides.items() if k.startswith(derived)})
  if args.steps is not None:
    cfg = dataclasses.replace(cfg, steps=args.steps)
  return cfg


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m paraflax.training", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser)
  args = parser.parse_args(argv)
  try:
    summary = run(args)
  except KeyboardInterrupt as e:  # Ctrl-C: one line saying what was saved; 128 + SIGINT
    print(f"{parser.prog}: {e or 'interrupted'}", file=sys.stderr)
    return 130
  except (ValueError, FileNotFoundError) as e:  # user errors: one line, no traceback
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:  # one summary per run, not per host
    print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
