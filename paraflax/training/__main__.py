"""`python -m paraflax.training --config configs/tiny_ar.py --workdir DIR [--steps N]`.

Trains (resuming from DIR's latest checkpoint if any) and prints the summary as JSON.
Multi-host: run it on every host with --coordinator/--num-processes/--process-id (or the
PARAFLAX_* environment, see `paraflax.distributed`) and a mesh, e.g. `--set mesh=(-1,1,1)`.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from paraflax import distributed
from paraflax.training.trainer import train_from_config_path


def parse_overrides(items: list[str]) -> dict[str, str]:
  """["data.cache_dir=/tmp/c", "optim.peak_lr=1e-3"] -> {dotted name: value string}."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"--set expects NAME=VALUE (e.g. optim.peak_lr=1e-3), got {item!r}")
    out[key.strip()] = value
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m paraflax.training", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="Python file exposing get_config()")
  parser.add_argument("--workdir", required=True, help="run directory (resumed if it exists)")
  parser.add_argument("--steps", type=int, default=None, help="override TrainConfig.steps")
  parser.add_argument("--max-steps", type=int, default=None,
                      help="stop at this step without changing the schedule")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="NAME=VALUE", help="dotted config override, repeatable")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  distributed.add_arguments(parser)
  args = parser.parse_args(argv)
  distributed.initialize_from_args(args)

  try:
    summary = train_from_config_path(args.config, args.workdir, steps=args.steps,
                                     overrides=parse_overrides(args.overrides),
                                     progress=not args.no_progress, max_steps=args.max_steps)
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
