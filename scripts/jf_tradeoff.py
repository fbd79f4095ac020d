"""Tokens per forward against held-out loss for Jacobi Forcing runs distilled from one base.

    python scripts/jf_tradeoff.py --base checkpoints/tiny_ar runs/jf_a runs/jf_b ... --out jf.png

Per run: greedy Jacobi (block 16) and the bench's MR (`methods.mr_decoder`) tokens/forward on
HumanEval prompts (exact vs the run's own greedy AR checked), held-out stdlib loss, the distinct
4-gram ratio of the greedy completions (the bench's: every prompt x 64 tokens) and the first
one's text, so a model collapsed into repetition is visible, as a number, next to its speed.
The plot puts both tokens/forward against held-out loss and against the 4-gram ratio, with the
issue's bounds (loss within 0.35 nats of the base, 4-grams within 20%; Jacobi 1.5, MR 2.5).
"""

import argparse
import json
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paraflax import decoders  # noqa: E402
from paraflax.decoding.generate import generate  # noqa: E402
from paraflax.evaluation.bench import Method, run_bench  # noqa: E402
from paraflax.evaluation.humaneval import humaneval_prompts  # noqa: E402
from paraflax.evaluation.quality import heldout_batches, heldout_loss  # noqa: E402
from paraflax.methods import MR_SETTINGS, mr_decoder  # noqa: E402
from paraflax.training import load_trained  # noqa: E402


def distinct_ngrams(rows, n: int = 4) -> float:
  """Distinct n-grams / all n-grams, pooled over token rows (none spans two rows)."""
  grams = [tuple(r[i:i + n]) for r in rows for i in range(len(r) - n + 1)]
  return len(set(grams)) / len(grams)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--base", required=True)
  ap.add_argument("runs", nargs="+")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--out", default="jf_tradeoff.png")
  ap.add_argument("--results", default="jf_tradeoff.jsonl",
                  help="one JSON line per run; runs already there (with this MR setting) are not "
                  "measured again")
  args = ap.parse_args()
  known = {}
  if Path(args.results).is_file():
    known = {r["run"]: r for r in map(json.loads, Path(args.results).read_text().splitlines())
             if r.get("mr_settings") == MR_SETTINGS}
  base, tok, _ = load_trained(args.base)
  prompts = humaneval_prompts(tok.encode, args.prompts, 192)
  mr = mr_decoder(16)
  results, val = [], heldout_batches(tok)
  for wd in [args.base] + args.runs:
    if wd in known:
      results.append(known[wd])
      continue
    model = load_trained(wd)[0]
    rows = run_bench(base, prompts, [Method("jacobi", decoders.Jacobi(16), model=model, weights=wd),
                                     Method("mr", mr, model=model, weights=wd)])
    out = jax.device_get(generate(model, prompts, max_new_tokens=64, eos_id=None))  # as bench
    rows_text = [t[:n].tolist() for t, n in zip(out.tokens, out.lengths)]
    r = {"run": wd, "mr_settings": MR_SETTINGS, "heldout_loss": heldout_loss(model, val),
         "jacobi_tokens_per_forward": rows[1].tokens_per_forward,
         "mr_tokens_per_forward": rows[2].tokens_per_forward,
         "exact": min(rows[1].exact_match_vs_ar, rows[2].exact_match_vs_ar),
         "distinct_4grams": distinct_ngrams(rows_text),
         "greedy_text": tok.decode(rows_text[0])}
    print(json.dumps(r), flush=True)
    with open(args.results, "a") as f:
      f.write(json.dumps(r) + "\n")
    results.append(r)
  base_r = results[0]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
  for ax, key, label in [
      (axes[0], "heldout_loss", "held-out stdlib loss (nats/token, lower is better)"),
      (axes[1], "distinct_4grams", "distinct 4-grams of the greedy completions (higher: less "
                                   "repetition)")]:
    for i, r in enumerate(results, 1):
      x = r[key]
      ax.plot([x, x], [r["jacobi_tokens_per_forward"], r["mr_tokens_per_forward"]], "-",
              color="0.7")
      ax.plot(x, r["jacobi_tokens_per_forward"], "o", color="C0")
      ax.plot(x, r["mr_tokens_per_forward"], "s", color="C1")
      ax.annotate(str(i), (x, r["mr_tokens_per_forward"]), fontsize=8, xytext=(4, 2),
                  textcoords="offset points")
    ax.set_xlabel(label)
    for y, color in ((1.5, "C0"), (2.5, "C1")):  # the Jacobi and MR targets
      ax.axhline(y, color=color, ls=":", lw=1)
  # the quality bounds: loss within 0.35 nats of the base, 4-grams within 20%
  axes[0].axvline(base_r["heldout_loss"] + 0.35, color="C2", ls="--", lw=1,
                  label="quality bound (base + 0.35 / base - 20%)")
  axes[1].axvline(0.8 * base_r["distinct_4grams"], color="C2", ls="--", lw=1)
  axes[0].plot([], [], "o", color="C0", label="Jacobi, block 16")
  axes[0].plot([], [], "s", color="C1", label=f"MR, n16 {MR_SETTINGS}")
  axes[0].set_ylabel("tokens per forward (HumanEval prompts)")
  axes[0].legend(fontsize=8, loc="upper left")
  axes[1].text(0.98, 0.98, "\n".join(f"{i}: {Path(r['run']).name}"
                                     for i, r in enumerate(results, 1)),
               transform=axes[1].transAxes, ha="right", va="top", fontsize=8)
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
