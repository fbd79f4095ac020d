"""The `paraflax` command: parse the flags, call the library, print (imports at run time)."""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import warnings

from paraflax import methods
from paraflax.paths import CACHE


def _call(fn, args):
  """`fn` (a function or a dataclass) called with the flags named like its parameters."""
  return fn(**{k: getattr(args, k) for k in inspect.signature(fn).parameters if hasattr(args, k)})


def cmd_train(args):
  from paraflax.training.__main__ import run
  print(json.dumps(run(args)))  # with --dry-run: the memory report, nothing trained or written


def cmd_generate(args):
  from paraflax.apps.generate import complete, show
  from paraflax.data.prompts import read_prompts
  prompts = read_prompts(args.prompt, args.prompts_file)
  show(*_call(functools.partial(complete, prompts), args), args.decoder, args.json)


def cmd_bench(args):
  from paraflax.evaluation import suite
  suite.run(_call(suite.Models, args), _call(suite.Settings, args))


def cmd_demo(args):
  from paraflax.apps import demo
  from paraflax.evaluation import suite
  demo.run(_call(suite.Models, args), _call(suite.Settings, args), cache=CACHE,
           shipped=args.shipped, quick=args.quick, retrain=args.retrain, ship=args.ship,
           steps=args.steps)


def cmd_perf(args):
  from paraflax.perf import cli as perf
  if args.part == "compile":  # for a target, with JAX on this host's CPU
    from paraflax.perf.compile.targets import check_process
    check_process()
  return perf.run(args, args.argv)


def cmd_collect(args):
  from paraflax.training.stores import collect, trajectories
  collect.main(args, _call(trajectories.CollectConfig, args), collect.collect_trajectories)


def cmd_teacher_data(args):
  from paraflax.training.stores import collect, teacher
  collect.main(args, _call(teacher.TeacherConfig, args), collect.teacher_data)


def cmd_convert(args):
  from paraflax.training.workdirs.convert import convert_hf
  info = convert_hf(args.from_hf, args.out, overwrite=args.overwrite)
  print(json.dumps({k: str(v) for k, v in info.items()}))


def cmd_export(args):
  from paraflax.loading import export_model
  out = export_model(args.workdir, args.hf, args.to_hf, overwrite=args.overwrite)
  print(f"wrote {out}")  # every EOS id, roles


def cmd_checksum(args):
  from paraflax.training.workdirs.checkpoint import checksum_workdir
  print(json.dumps(checksum_workdir(args.workdir, args.step)))


def _ints(q, **defaults):
  """Integer flags without help, in order: `max_new_tokens=64` is `--max-new-tokens 64`."""
  for name, default in defaults.items():
    q.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="paraflax", description="Exact, batched, compile-once "
                              "parallel decoding for language models (JAX/Flax).")
  sub = p.add_subparsers(dest="command", required=True)

  def command(name, fn, help_):
    q = sub.add_parser(name, help=help_)
    q.set_defaults(fn=fn)
    return q

  t = command("train", cmd_train, "train a model from a config file (resumes from --workdir)")
  from paraflax.training.__main__ import add_arguments
  add_arguments(t)

  def model_flags(q):
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", metavar="DIR", help="a training workdir, a `paraflax convert` "
                     "output or a Hugging Face directory")
    src.add_argument("--hf", metavar="DIR", help="a local Hugging Face checkpoint directory")

  g = command("generate", cmd_generate, "complete text prompts, in one batch, with any decoder")
  model_flags(g)
  g.add_argument("--prompt", action="append", metavar="TEXT", help="a text (repeatable)")
  g.add_argument("--prompts-file", metavar="FILE.jsonl", help="{\"prompt\": TEXT} or chat "
                 "{\"messages\": [...]} records")
  g.add_argument("--chat", action="store_true", help="wrap each --prompt as a user turn of "
                 "the model's chat template")
  g.add_argument("--json", action="store_true", help="print one JSON object: ids, text, counts")
  _ints(g, max_new_tokens=64)
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=int, default=0)
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--decoder", default="ar", metavar="NAME",
                 help=f"one of {', '.join(methods.names())}")
  g.add_argument("--block-size", type=int, metavar="N", help="tokens per step: Jacobi block, "
                 "drafts of tidar, speculative, deer, prompt-lookup (default: the bench's)")
  g.add_argument("--ngram", type=int, metavar="N", help="prompt-lookup: longest n-gram "
                 "matched (default 3)")
  g.add_argument("--draft", metavar="DIR", help="the drafter of speculative and deer: a workdir "
                 "or HF dir")

  def bench_flags(q):
    q.add_argument("--prompts", type=int, default=8, help="number of prompts (HumanEval's, "
                   "or the first of --prompts-file)")
    q.add_argument("--prompts-file", metavar="FILE.jsonl", help="bench on these prompts "
                   "({\"prompt\": TEXT} or chat {\"messages\": [...]} records) instead of "
                   "HumanEval's (no pass@1 then)")
    q.add_argument("--eval-data", metavar="FILE.jsonl", help="report every weights' loss on "
                   "these records (text, prompt/response or chat; loss on responses)")
    _ints(q, max_new_tokens=64, max_prompt_tokens=192, batch_size=4)
    q.add_argument("--json", default=None, help="write per-method results to this file, and "
                   "the plots (bench_speed.png, bench_accepted.png) beside it")
    for flag, help_ in (
        ("--jf-workdir", "a Jacobi Forcing model distilled from the base (adds its rows)"),
        ("--tidar-workdir", "a TiDAR model trained on from the base (adds TiDAR rows)"),
        ("--deer-workdir", "a DEER diffusion drafter for the base (adds deer_k4/8/16 rows)"),
        ("--ar-drafter-workdir", "a small AR drafter for the base (adds spec_ar_k4/8/16 rows)"),
        ("--asarm-workdir", "an AS-ARM with the base's tokenizer (adds the any-subset table)")):
      q.add_argument(flag, default=None, help=help_)
    q.add_argument("--infill-windows", type=int, default=64,
                   help="held-out windows for the AS-ARM's 95%%-masking generation task")
    q.add_argument("--infill-length", type=int, default=128, help="tokens per such window")

  b = command("bench", cmd_bench, "every method side by side on HumanEval prompts")
  model_flags(b)
  bench_flags(b)

  d = command("demo", cmd_demo, "train (or reuse) the tiny models, then bench them")
  d.add_argument("--retrain", action="store_true", help="retrain from scratch")
  d.add_argument("--steps", type=int, default=None, help="override the training steps")
  d.add_argument("--shipped", metavar="DIR", help="start from the "
                 "params-only models here (default: the clone's checkpoints/, when the demo "
                 "runs from its root); the ones missing are trained")
  d.add_argument("--ship", action="store_true",
                 help="with --retrain: store the results in --shipped")
  d.add_argument("--quick", action="store_true", help="a smaller bench: 4 prompts x 32 tokens")
  d.add_argument("--hf", default=None, help="bench this local Hugging Face checkpoint instead")
  bench_flags(d)

  from paraflax.training.stores import collect
  j = command("collect-trajectories", cmd_collect, "store the model's own greedy Jacobi "
              "trajectories on training prompts (Jacobi Forcing data; resumable)")
  collect.add_source_arguments(j, "the model")
  j.add_argument("--out", required=True, help="trajectory store directory")
  _ints(j, block_size=16, num_blocks=4, examples=2048, min_prompt_len=32, max_prompt_len=96,
        batch_size=64, seed=0)
  collect.add_mesh_arguments(j)

  td = command("teacher-data", cmd_teacher_data, "store the model's greedy continuations of "
               "training prompts (DEER drafter training data; resumable)")
  collect.add_source_arguments(td, "the AR teacher")
  td.add_argument("--out", required=True, help="teacher store directory")
  _ints(td, examples=2048)
  td.add_argument("--answer-len", type=int, default=128, help="greedy tokens per prompt")
  _ints(td, min_prompt_len=32, max_prompt_len=96, batch_size=64, seed=0)
  collect.add_mesh_arguments(td)

  c = command("convert", cmd_convert, "Hugging Face checkpoint -> paraflax (orbax) directory")
  c.add_argument("--from-hf", required=True, help="local HF directory (safetensors)")
  c.add_argument("--out", required=True, help="output directory: new or empty (see --overwrite)")
  c.add_argument("--overwrite", action="store_true", help="replace a non-empty --out once the "
                 "new one is complete (never a training workdir, a store or --from-hf itself)")

  e = command("export", cmd_export, "paraflax model -> a Hugging Face directory (weights, "
              "config, generation config, tokenizer files)")
  model_flags(e)
  e.add_argument("--to-hf", required=True, help="output directory: new or empty (see "
                 "--overwrite)")
  e.add_argument("--overwrite", action="store_true", help="replace a non-empty --to-hf once "
                 "the new export is complete (never a training workdir, a store or the model's "
                 "own directory)")

  f = command("perf", cmd_perf, "measure this device: slot cost, decode steps, training "
              "steps (MFU), the demo family; JSON rows and markdown tables")
  from paraflax.perf.cli import add_arguments as perf_arguments
  perf_arguments(f)

  k = command("checksum", cmd_checksum, "verify a workdir's checkpoints against their "
              "checksums; write them for a checkpoint that has none (older runs)")
  k.add_argument("--workdir", required=True, help="a training workdir")
  k.add_argument("--step", type=int, default=None, help="only this step (default: every one)")
  return p


def _one_line_warnings(command: str, fallback):
  """A `warnings.showwarning` printing paraflax's own warnings as one line."""
  def show(message, category, filename, lineno, file=None, line=None):
    if not category.__module__.startswith("paraflax"):
      return fallback(message, category, filename, lineno, file, line)
    print(f"paraflax {command}: warning: {message}", file=sys.stderr)
  return show


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  args.argv = argv  # (perf rows name the command that measured them)
  import jax  # later runs of the same shapes skip XLA compilation (a dry run measures it)
  if not (getattr(args, "dry_run", False) or getattr(args, "part", None) == "compile"):
    jax.config.update("jax_compilation_cache_dir", str(CACHE / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  with warnings.catch_warnings():
    warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
    return _run(args)


def _run(args) -> int:
  try:
    return args.fn(args) or 0
  except (ValueError, OSError) as e:  # user errors, missing files, full disks: one line
    print(f"paraflax {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:  # Ctrl-C: one line saying what was kept; 128 + SIGINT
    print(f"paraflax {args.command}: {e or 'interrupted'}", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
