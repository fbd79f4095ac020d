"""The `paraflax` command. Subcommands import what they need when they run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPO_CONFIGS = REPO / "configs"
SHIPPED = REPO / "checkpoints"  # params-only snapshots made by `paraflax demo --retrain --ship`
CACHE = Path(os.environ.get("PARAFLAX_CACHE", "~/.cache/paraflax")).expanduser()


def _sampler(args):
  """The sampler of --temperature/--top-k/--top-p; a combination that would ignore a flag is
  a ValueError (temperature 0 is greedy: no top-k or top-p; top-k and top-p are exclusive)."""
  from paraflax import sampling
  if args.top_k < 0 or not 0 < args.top_p <= 1:
    raise ValueError(f"--top-k must be >= 0 (0 = off) and --top-p in (0, 1] (1 = off), got "
                     f"{args.top_k} and {args.top_p}")
  if args.temperature == 0 and (args.top_k or args.top_p < 1):
    flag = "--top-k" if args.top_k else "--top-p"
    raise ValueError(f"{flag} needs --temperature > 0 (temperature 0 is greedy decoding, "
                     f"which would ignore {flag})")
  if args.top_k and args.top_p < 1:
    raise ValueError("give --top-k or --top-p, not both")
  if args.temperature == 0:
    return sampling.Greedy()
  if args.top_k:
    return sampling.TopK(args.top_k, temperature=args.temperature)
  if args.top_p < 1:
    return sampling.TopP(args.top_p, temperature=args.temperature)
  return sampling.Temperature(args.temperature)


def cmd_train(args):
  from paraflax import distributed
  from paraflax.training import train_from_config_path
  from paraflax.training.__main__ import parse_overrides
  distributed.initialize_from_args(args)  # no-op unless multi-host flags or env are set
  summary = train_from_config_path(args.config, args.workdir, steps=args.steps,
                                   overrides=parse_overrides(args.overrides))
  print(json.dumps(summary))


def load_model(args):
  """(model, tokenizer, encode) from --hf DIR (a Hugging Face checkpoint) or --workdir DIR (a
  training run or a `paraflax convert` output)."""
  from paraflax import hf
  if args.hf:
    tok = hf.load_hf_tokenizer(args.hf)
    return hf.load_hf(args.hf), tok, lambda text: hf.encode_prompt(tok, text)
  from paraflax.training import load_trained
  model, tok, _ = load_trained(args.workdir)
  if (Path(args.workdir) / "hf_config.json").is_file():  # converted: keep the HF EOS/BOS
    tok = hf.load_hf_tokenizer(args.workdir)
    return model, tok, lambda text: hf.encode_prompt(tok, text)
  return model, tok, tok.encode


def cmd_generate(args):
  import jax
  from paraflax import decoders
  from paraflax.decoding.generate import generate
  decoder = decoders.AR(_sampler(args))  # flag errors before loading the model
  decoder.sampler.validate()
  model, tok, encode = load_model(args)
  prompt = encode(args.prompt)
  if not prompt:
    raise SystemExit("--prompt encodes to no tokens: give some text")
  kw = dict(decoder=decoder, max_new_tokens=args.max_new_tokens,
            rng=jax.random.key(args.seed), eos_id=tok.eos_id)
  jax.block_until_ready(generate(model, [prompt], **kw).tokens)  # compile
  t0 = time.perf_counter()
  out = jax.device_get(generate(model, [prompt], **kw))
  seconds = time.perf_counter() - t0
  n = int(out.lengths[0])
  print(args.prompt + tok.decode(out.tokens[0, :n].tolist()))
  print(f"\n[{n} tokens in {seconds:.3f}s: {n / seconds:.1f} tokens/s, "
        f"{int(out.forwards[0]) + 1} forwards]", file=sys.stderr)


def humaneval_prompts(encode, n: int, max_tokens: int) -> list[list[int]]:
  """The first n HumanEval prompts, tokenised, keeping the last `max_tokens` tokens."""
  from paraflax.data import load_humaneval
  return [encode(p.prompt)[-max_tokens:] for p in load_humaneval()[:n]]


def bench_methods(others=None, drafters=None):
  """Every method the bench runs after the AR baseline. `others` maps a weights name to a
  model of the base's architecture and tokenizer: "jf" (Jacobi Forcing, distilled from the
  base) adds its rows, "tidar" (TiDAR, trained on from the base) adds TiDAR rows. `drafters`
  maps "deer" (a DEER block-diffusion drafter) and "ar_drafter" (a small AR drafter) to draft
  models for the base: speculative rows at k = 4, 8, 16."""
  from paraflax import decoders
  from paraflax.evaluation.bench import Method
  others, drafters = others or {}, drafters or {}
  methods = [Method("jacobi", decoders.Jacobi(block_size=16), "block 16"),
             Method("prompt_lookup", decoders.PromptLookup(max_ngram=3, num_tokens=8), "n<=3 k=8")]
  if "jf" in others:
    jf = others["jf"]
    mr = decoders.Jacobi(block_size=16, num_blocks=2, pool_size=16, num_candidates=2)
    methods += [Method("jacobi_forcing", decoders.Jacobi(block_size=16), "block 16",
                       model=jf, weights="jf"),
                Method("jacobi_forcing_mr", mr, "n16 K2 pool16 C2", model=jf, weights="jf")]
  if "tidar" in others:
    methods += [Method(f"tidar_k{k}", decoders.TiDAR(block_size=k, beta=1.0), f"block {k} beta 1",
                       model=others["tidar"], weights="tidar") for k in (4, 8, 16)]
  for name, kind, key in (("deer", "diffusion", "deer"), ("spec_ar", "ar", "ar_drafter")):
    if key in drafters:
      methods += [Method(f"{name}_k{k}", decoders.Speculative(k, drafter=kind), f"block {k}",
                         draft_model=drafters[key]) for k in (4, 8, 16)]
  return methods


def humaneval_pass_at_1(model, tok, prompts, args) -> float:
  """pass@1 of the model's greedy completions of the bench's HumanEval prompts (executed in a
  sandbox; `prompts` are the first problems' prompts, tokenised)."""
  import jax
  from paraflax.data import load_humaneval
  from paraflax.decoding.generate import generate
  from paraflax.evaluation.humaneval import pass_at_1
  out = jax.device_get(generate(model, prompts, max_new_tokens=args.max_new_tokens,
                                eos_id=tok.eos_id))
  texts = [tok.decode(row[:n].tolist()) for row, n in zip(out.tokens, out.lengths)]
  return pass_at_1(load_humaneval()[:len(prompts)], texts)


OTHER_WEIGHTS = {"jf": "jf_workdir", "tidar": "tidar_workdir"}  # weights name -> bench flag
DRAFTERS = {"deer": "deer_workdir", "ar_drafter": "ar_drafter_workdir"}  # drafter -> flag


def _load_related(args, flag, tok, same_vocab):
  """A model trained with the base's tokenizer (a clear error otherwise)."""
  from paraflax.training import load_trained
  other, other_tok, _ = load_trained(getattr(args, flag))
  if other_tok.fingerprint() != tok.fingerprint() or other.cfg.vocab_size != same_vocab:
    raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)!r} was not trained "
                     "with the base model's tokenizer and vocabulary")
  return other


def infill_bench(asarm, judge, tok, args) -> list:
  """Sequential vs ASSD (self, n-gram; k = 5) of the AS-ARM on 95%-masked held-out stdlib
  windows (sampled, gen-PPL under `judge` and entropy) and on HumanEval single-line infilling
  (greedy, pass@1)."""
  import numpy as np
  from paraflax import sampling
  from paraflax.data import load_humaneval
  from paraflax.decoders import ASSD, AnyOrder
  from paraflax.evaluation import infill_bench as ib
  from paraflax.evaluation.quality import heldout_batches
  batches = heldout_batches(tok, batches=-(-args.infill_windows // 8), batch_size=8)
  windows = np.concatenate([b["tokens"] for b in batches])
  windows = windows[:args.infill_windows, :args.infill_length]
  sampled = sampling.Temperature(1.0)
  rows = ib.run_infill_bench(
      asarm, [("any_order", "T=1", AnyOrder(sampled)),
              ("assd_self", "k=5 T=1", ASSD(5, sampler=sampled)),
              ("assd_ngram", "k=5 T=1", ASSD(5, draft="ngram", sampler=sampled))],
      "generate", ib.masked_windows(windows, 0.95), judge=judge, batch_size=args.batch_size)
  tasks = ib.single_line_tasks(tok.encode, load_humaneval()[:args.prompts],
                               min(256, asarm.cfg.max_seq_len), tok.eos_id)
  rows += ib.run_infill_bench(
      asarm, [("any_order", "greedy", AnyOrder()), ("assd_self", "k=5 greedy", ASSD(5)),
              ("assd_ngram", "k=5 greedy", ASSD(5, draft="ngram"))],
      "line", np.stack([t.canvas for t in tasks]), line_tasks=tasks, decode=tok.decode,
      batch_size=args.batch_size)
  return rows


def cmd_bench(args):
  from paraflax.evaluation import bench
  from paraflax.evaluation.quality import heldout_batches, heldout_loss, heldout_metrics
  model, tok, encode = load_model(args)
  loaded = lambda flags: {name: _load_related(args, flag, tok, model.cfg.vocab_size)
                          for name, flag in flags.items() if getattr(args, flag, None)}
  others, drafters = loaded(OTHER_WEIGHTS), loaded(DRAFTERS)
  max_prompt = min(args.max_prompt_tokens, model.cfg.max_seq_len - args.max_new_tokens)
  prompts = humaneval_prompts(encode, args.prompts, max_prompt)
  rows = bench.run_bench(model, prompts, bench_methods(others, drafters),
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         eos_id=tok.eos_id)
  print(bench.format_table(rows))
  weights = {"base": model, **others}
  quality = {w: {"humaneval_pass_at_1": humaneval_pass_at_1(m, tok, prompts, args)}
             for w, m in weights.items()}
  print(f"HumanEval pass@1 (greedy AR of each weights = every exact method's output; "
        f"{len(prompts)} problems, {args.max_new_tokens} tokens): " + ", ".join(
            f"{w} {q['humaneval_pass_at_1']:.2f}" for w, q in quality.items()))
  if others:  # other weights than the base: how much did quality move?
    val = heldout_batches(tok)
    for w, m in weights.items():
      quality[w]["heldout_loss"] = heldout_loss(m, val)
    if "tidar" in others:  # the diffusion mode's own loss, next to its AR mode's
      quality["tidar"]["heldout_diffusion_loss"] = heldout_metrics(
          others["tidar"], val, "tidar", {"block_size": 8})["diff_loss"]
    print("held-out stdlib loss (nats/token, AR mode): " + ", ".join(
        f"{w} {q['heldout_loss']:.3f}" for w, q in quality.items())
        + ("" if "tidar" not in quality else
           f"; tidar diffusion mode (block 8) {quality['tidar']['heldout_diffusion_loss']:.3f}"))
  infill_rows = []
  if getattr(args, "asarm_workdir", None):
    from paraflax.evaluation.infill_bench import format_infill_table
    asarm = _load_related(args, "asarm_workdir", tok, model.cfg.vocab_size)
    infill_rows = infill_bench(asarm, model, tok, args)
    print("\nAS-ARM any-subset decoding (judge for gen-PPL: the base model; speedup vs "
          "the AS-ARM's sequential sampler):")
    print(format_infill_table(infill_rows))
  if args.json:
    path = bench.write_json(list(rows) + infill_rows, args.json, by_weights=quality)
    print(f"wrote {path}")
    for png in bench.plot(rows, path.parent):
      print(f"wrote {png}")


def cmd_demo(args):
  """The tiny models (shipped or trained), a few completions, then the bench. `--hf DIR` benches
  a local Hugging Face checkpoint instead; `--quick` benches 4 prompts x 32 tokens."""
  from paraflax.evaluation import demo
  if args.quick:
    args.prompts, args.max_new_tokens = min(args.prompts, 4), min(args.max_new_tokens, 32)
  args.json = args.json or str(CACHE / "demo" / "bench.json")
  if args.hf:
    print(f"\n[demo] bench of the Hugging Face checkpoint {args.hf} on HumanEval prompts:")
    args.workdir = None
    return cmd_bench(args)
  if not (REPO_CONFIGS / "tiny_ar.py").is_file():
    raise SystemExit(f"{REPO_CONFIGS} not found: run the demo from a clone of the repository")
  build = demo.Build(cache=CACHE / "demo", configs=REPO_CONFIGS, shipped=SHIPPED,
                     retrain=args.retrain, ship=args.ship, steps=args.steps)
  args.workdir = str(demo.ensure("tiny_ar", build))
  args.jf_workdir = args.jf_workdir or str(demo.ensure(demo.JACOBI_FORCING, build))
  args.tidar_workdir = args.tidar_workdir or str(demo.ensure("tidar_continual", build))
  args.deer_workdir = args.deer_workdir or str(demo.ensure("deer_drafter", build))
  args.ar_drafter_workdir = args.ar_drafter_workdir or str(demo.ensure("ar_drafter", build))
  args.asarm_workdir = args.asarm_workdir or str(demo.ensure("asarm", build))
  import jax
  from paraflax.decoding.generate import generate
  model, tok, _ = load_model(args)
  print("\n[demo] HumanEval completions (greedy AR):")
  prompts = humaneval_prompts(tok.encode, 3, 192)
  out = jax.device_get(generate(model, prompts, max_new_tokens=48, eos_id=tok.eos_id))
  for p, row, n in zip(prompts, out.tokens, out.lengths):
    print("-" * 60 + "\n" + tok.decode(p[-60:]) + "\033[1m" + tok.decode(row[:n].tolist())
          + "\033[0m")
  print("\n[demo] bench on HumanEval prompts:")
  cmd_bench(args)


def collect_trajectories(workdir, out, cfg) -> dict:
  """`trajectories.collect` of a training workdir's model on prompts from its training split."""
  from paraflax.data.pipeline import prepare_stdlib
  from paraflax.training import load_trained, trajectories
  model, tok, train_cfg = load_trained(workdir)
  data = prepare_stdlib(train_cfg.data, tokenizer=tok)
  out = trajectories.collect(model, tok, data.train_tokens, out, cfg, source=str(workdir))
  iters = trajectories.load(out).iterations
  return {"out": str(out), "examples": len(iters), "block_size": cfg.block_size,
          "mean_iterations_per_block": float(iters.mean())}


def cmd_collect(args):
  from paraflax.training.trajectories import CollectConfig
  cfg = CollectConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                      examples=args.examples, min_prompt_len=args.min_prompt_len,
                      max_prompt_len=args.max_prompt_len, batch_size=args.batch_size,
                      seed=args.seed)
  print(json.dumps(collect_trajectories(args.workdir, args.out, cfg)))


def teacher_data(workdir, out, cfg) -> dict:
  """`teacher.collect` of a training workdir's model (the AR teacher) on prompts from its
  training split: the DEER drafters' training data. Returns a summary."""
  from paraflax.data.pipeline import prepare_stdlib
  from paraflax.training import load_trained, teacher
  model, tok, train_cfg = load_trained(workdir)
  data = prepare_stdlib(train_cfg.data, tokenizer=tok)
  t0 = time.perf_counter()
  out = teacher.collect(model, tok, data.train_tokens, out, cfg, source=str(workdir))
  seconds = time.perf_counter() - t0
  store = teacher.load(out)
  return {"out": str(out), "examples": len(store.answers), "answer_len": cfg.answer_len,
          "prompt_tokens": int(store.prompt_lens.sum()), "answer_tokens": int(store.answers.size),
          "seconds_this_run": round(seconds, 1)}


def cmd_teacher_data(args):
  from paraflax.training.teacher import TeacherConfig
  cfg = TeacherConfig(examples=args.examples, answer_len=args.answer_len,
                      min_prompt_len=args.min_prompt_len, max_prompt_len=args.max_prompt_len,
                      batch_size=args.batch_size, seed=args.seed)
  print(json.dumps(teacher_data(args.workdir, args.out, cfg)))


def cmd_convert(args):
  from paraflax import hf
  info = hf.convert_hf(args.from_hf, args.out)
  print(json.dumps({k: str(v) for k, v in info.items()}))


def cmd_export(args):
  from paraflax import hf
  model, tok, _ = load_model(args)
  print(f"wrote {hf.export_hf(model, args.to_hf, tokenizer=tok)}")


def cmd_checksum(args):
  from paraflax.training.checkpoint import checksum_workdir
  print(json.dumps(checksum_workdir(args.workdir, args.step)))


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="paraflax", description="Exact, batched, compile-once "
                              "parallel decoding for language models (JAX/Flax).")
  sub = p.add_subparsers(dest="command", required=True)

  t = sub.add_parser("train", help="train a model from a config file (resumes from --workdir)")
  t.add_argument("--config", required=True, help="Python file exposing get_config()")
  t.add_argument("--workdir", required=True)
  t.add_argument("--steps", type=int, default=None)
  t.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                 help="dotted config override, repeatable (e.g. optim.peak_lr=1e-3, "
                 "mesh=(2,2,2))")
  from paraflax import distributed
  distributed.add_arguments(t)
  t.set_defaults(fn=cmd_train)

  def sampling_flags(q):
    q.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    q.add_argument("--top-k", type=int, default=0)
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--seed", type=int, default=0)

  def model_flags(q):
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a training workdir or a `paraflax convert` output")
    src.add_argument("--hf", help="a local Hugging Face checkpoint directory")

  g = sub.add_parser("generate", help="complete a text prompt with a trained model")
  model_flags(g)
  g.add_argument("--prompt", required=True)
  g.add_argument("--max-new-tokens", type=int, default=64)
  sampling_flags(g)
  g.set_defaults(fn=cmd_generate)

  def bench_flags(q):
    q.add_argument("--prompts", type=int, default=8, help="number of HumanEval prompts")
    q.add_argument("--max-new-tokens", type=int, default=64)
    q.add_argument("--max-prompt-tokens", type=int, default=192)
    q.add_argument("--batch-size", type=int, default=4)
    q.add_argument("--json", default=None, help="write per-method results to this file, and "
                   "the plots (bench_speed.png, bench_accepted.png) beside it")
    q.add_argument("--jf-workdir", default=None,
                   help="a Jacobi Forcing model distilled from the base (adds its rows)")
    q.add_argument("--tidar-workdir", default=None,
                   help="a TiDAR model trained on from the base (adds TiDAR rows)")
    q.add_argument("--deer-workdir", default=None,
                   help="a DEER diffusion drafter for the base (adds deer_k4/8/16 rows)")
    q.add_argument("--ar-drafter-workdir", default=None,
                   help="a small AR drafter for the base (adds spec_ar_k4/8/16 rows)")
    q.add_argument("--asarm-workdir", default=None,
                   help="an AS-ARM with the base's tokenizer (adds the any-subset table)")
    q.add_argument("--infill-windows", type=int, default=64,
                   help="held-out windows for the AS-ARM's 95%%-masking generation task")
    q.add_argument("--infill-length", type=int, default=128, help="tokens per such window")

  b = sub.add_parser("bench", help="every method side by side on HumanEval prompts")
  model_flags(b)
  bench_flags(b)
  b.set_defaults(fn=cmd_bench)

  d = sub.add_parser("demo", help="train (or reuse) the tiny models, then bench them")
  d.add_argument("--retrain", action="store_true", help="retrain from scratch")
  d.add_argument("--steps", type=int, default=None, help="override the training steps")
  d.add_argument("--ship", action="store_true",
                 help="with --retrain: store the result as the repository's shipped checkpoint")
  d.add_argument("--quick", action="store_true", help="a smaller bench: 4 prompts x 32 tokens")
  d.add_argument("--hf", default=None, help="bench this local Hugging Face checkpoint instead")
  bench_flags(d)
  d.set_defaults(fn=cmd_demo)

  j = sub.add_parser("collect-trajectories", help="store the model's own greedy Jacobi "
                     "trajectories on training prompts (Jacobi Forcing data; resumable)")
  j.add_argument("--workdir", required=True, help="the model: a training workdir")
  j.add_argument("--out", required=True, help="trajectory store directory")
  j.add_argument("--block-size", type=int, default=16)
  j.add_argument("--num-blocks", type=int, default=4)
  j.add_argument("--examples", type=int, default=2048)
  j.add_argument("--min-prompt-len", type=int, default=32)
  j.add_argument("--max-prompt-len", type=int, default=96)
  j.add_argument("--batch-size", type=int, default=64)
  j.add_argument("--seed", type=int, default=0)
  j.set_defaults(fn=cmd_collect)

  td = sub.add_parser("teacher-data", help="store the model's greedy continuations of training "
                      "prompts (DEER drafter training data; resumable)")
  td.add_argument("--workdir", required=True, help="the AR teacher: a training workdir")
  td.add_argument("--out", required=True, help="teacher store directory")
  td.add_argument("--examples", type=int, default=2048)
  td.add_argument("--answer-len", type=int, default=128, help="greedy tokens per prompt")
  td.add_argument("--min-prompt-len", type=int, default=32)
  td.add_argument("--max-prompt-len", type=int, default=96)
  td.add_argument("--batch-size", type=int, default=64)
  td.add_argument("--seed", type=int, default=0)
  td.set_defaults(fn=cmd_teacher_data)

  c = sub.add_parser("convert", help="Hugging Face checkpoint -> paraflax (orbax) directory")
  c.add_argument("--from-hf", required=True, help="local HF directory (safetensors)")
  c.add_argument("--out", required=True)
  c.set_defaults(fn=cmd_convert)

  e = sub.add_parser("export", help="paraflax model -> Hugging Face safetensors + config.json")
  model_flags(e)
  e.add_argument("--to-hf", required=True, help="output directory")
  e.set_defaults(fn=cmd_export)

  k = sub.add_parser("checksum", help="verify a workdir's checkpoints against their checksums; "
                     "write them for a checkpoint that has none (older runs)")
  k.add_argument("--workdir", required=True, help="a training workdir")
  k.add_argument("--step", type=int, default=None, help="only this step (default: every one)")
  k.set_defaults(fn=cmd_checksum)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  import jax  # later runs of the same shapes skip XLA compilation
  jax.config.update("jax_compilation_cache_dir", str(CACHE / "jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  try:
    args.fn(args)
  except (ValueError, FileNotFoundError) as e:  # user errors: one line, no traceback
    print(f"paraflax {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:  # Ctrl-C: one line saying what was kept; 128 + SIGINT
    print(f"paraflax {args.command}: {e or 'interrupted'}", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
