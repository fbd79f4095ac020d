"""DEER drafters against the small AR drafter on equal supervision (docs/methods/speculative.md).

  python scripts/drafter_comparison.py --teacher ~/.cache/paraflax/deer/teacher \
      [--drafter NAME WORKDIR CONFIGS ...] [--json FILE]

Per drafter: its supervised target tokens, the positions that carry a loss over all its
training stages (CONFIGS: comma-separated recipe names, "" for none), replayed exactly from
the teacher store's batches and the trainer's keys (`training.deer.supervised_targets`); then
on the bench's prompts (8 HumanEval prompts x 64 greedy tokens, batch 4, verifier
checkpoints/tiny_ar) at k = 4 / 8 / 16: drafts accepted per block (mean), first-draft accuracy
(the share of blocks whose first draft is the verifier's greedy token, i.e. that accept at
least one; a row's last block, cut by the 64-token budget, can count as a miss), tokens per
target forward (prefill included), tokens/s against greedy AR (the best of 5 interleaved runs
each) and the share of rows equal to greedy AR.
"""

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from paraflax import decoders
from paraflax.evaluation.bench import Method, run_bench
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.loading import load_drafter, load_model
from paraflax.training.config.overrides import apply_overrides
from paraflax.training.config.train import load_config
from paraflax.training.objectives.deer import supervised_targets

REPO = Path(__file__).resolve().parents[1]
DRAFTERS = [  # (name, workdir, the configs of its training stages)
    ("DEER", "checkpoints/deer_drafter", "deer_drafter_stage1,deer_drafter"),
    ("AR drafter", "checkpoints/ar_drafter", "ar_drafter"),
]
KS = (4, 8, 16)
ROUNDS = 5


def targets(configs: str, teacher: str) -> int:
  """Supervised target tokens summed over the stages `configs` (recipe names)."""
  return sum(supervised_targets(apply_overrides(load_config(c),
                                                {"data_source_args.path": teacher}))
             for c in configs.split(","))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--verifier", default=str(REPO / "checkpoints/tiny_ar"))
  p.add_argument("--teacher", help="the teacher store the drafters trained on (for the counts)")
  p.add_argument("--drafter", nargs=3, action="append", metavar=("NAME", "WORKDIR", "CONFIGS"),
                 help="a drafter to compare (default: the shipped DEER and AR drafters)")
  p.add_argument("--json", help="write the rows here")
  args = p.parse_args()
  jax.config.update("jax_default_matmul_precision", "highest")  # exactness holds in float32

  model, tok, encode = load_model(args.verifier, None)
  prompts = humaneval_prompts(encode, 8, min(192, model.cfg.max_seq_len - 64))
  rows = []
  for name, workdir, configs in args.drafter or DRAFTERS:
    draft, vocab = load_drafter(str(REPO / workdir), None, tok, model)
    kind = decoders.Speculative if draft.cfg.mask_token_id is None else decoders.DEER
    count = targets(configs, args.teacher) if args.teacher and configs else None
    # ROUNDS interleaved rounds of AR and every k, the best tokens/s of each kept: the cores
    # are shared with other jobs, whose load comes and goes
    one = [Method("ar", decoders.AR(), "greedy")] + [
        Method(f"k{k}", kind(k, vocab=vocab), draft_model=draft) for k in KS]
    bench = run_bench(model, prompts, one * ROUNDS, eos_id=tok.eos_ids)
    ar_tps = max(r.tokens_per_second for r in bench[::len(one)])
    for i, k in enumerate(KS):
      runs = bench[i + 1::len(one)]
      r, steps = runs[0], np.asarray(runs[0].accepted_histogram)
      rows.append({"drafter": name, "prefix": draft.cfg.drafter_prefix, "targets": count,
                   "k": k, "accepted": r.mean_accepted,
                   "first_draft_accuracy": float(steps[2:].sum() / steps[1:].sum()),
                   "tokens_per_forward": r.tokens_per_forward,
                   "speedup_vs_ar": max(x.tokens_per_second for x in runs) / ar_tps,
                   "exact": min(x.exact_match_vs_ar for x in runs)})
      print(json.dumps(rows[-1]), flush=True)

  print("\n| drafter | supervised target tokens | k | accepted drafts / block | first-draft "
        "accuracy | tokens/forward | tokens/s vs AR | exact vs AR |\n|---|---|---|---|---|---|---|---|")
  for r in rows:
    count = f"{r['targets']:,}" if r["targets"] else "-"
    print(f"| {r['drafter']} | {count} | {r['k']} | {r['accepted']:.2f} | "
          f"{r['first_draft_accuracy']:.2f} | {r['tokens_per_forward']:.2f} | "
          f"{r['speedup_vs_ar']:.2f}x | {r['exact']:.2f} |")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
