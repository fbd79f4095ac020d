"""Tokens per forward of Jacobi, MR under both recycling rules, and prompt lookup, on the base
and the Jacobi Forcing weights (docs/methods/jacobi.md).

    python scripts/mr_rules.py --base checkpoints/tiny_ar --jf checkpoints/jacobi_forcing_r1

HumanEval prompts x 64 greedy tokens, batch 4, EOS on, as `paraflax bench`; prints a Markdown
table (tokens/forward counts the prefill; every row is checked exact vs its weights' AR).
"""

import argparse

from paraflax import decoders as d
from paraflax.evaluation.bench import Method, run_bench
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.methods import MR_SETTINGS, mr_decoder
from paraflax.training import load_trained

OLD = {"recycling": "rejected_drafts"}
METHODS = [  # (label, decoder)
    ("Jacobi, n=16", d.Jacobi(16)),
    ("MR, rejected_drafts, K2 pool16 C2 (the old bench setting)",
     d.JacobiMR(16, num_blocks=2, pool_size=16, num_candidates=2, **OLD)),
    (f"MR, rejected_drafts, {MR_SETTINGS}", mr_decoder(16).replace(**OLD)),
    ("MR, released, K1 pool4 C3 (the released grid's pool)",
     d.JacobiMR(16, pool_size=4, num_candidates=3)),
    (f"**MR, released, {MR_SETTINGS} (the bench's)**", mr_decoder(16)),
    ("MR, released, K2 pool16 C3", d.JacobiMR(16, num_blocks=2, pool_size=16, num_candidates=3)),
    ("prompt lookup, n<=3 k=8", d.PromptLookup(max_ngram=3, num_tokens=8)),
]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--base", required=True)
  ap.add_argument("--jf", required=True)
  ap.add_argument("--prompts", type=int, default=8)
  args = ap.parse_args()
  base, tok, _ = load_trained(args.base)
  prompts = humaneval_prompts(tok.encode, args.prompts, min(192, base.cfg.max_seq_len - 64))
  cols = {}
  for name, wd in (("base", args.base), ("jf", args.jf)):
    model = base if wd == args.base else load_trained(wd)[0]
    rows = run_bench(base, prompts, [Method(label, dec, model=model, weights=name)
                                     for label, dec in METHODS], eos_id=tok.eos_ids)
    assert all(r.exact_match_vs_ar == 1.0 for r in rows), [(r.method, r.exact_match_vs_ar)
                                                          for r in rows]
    cols[name] = [r.tokens_per_forward for r in rows[1:]]
  print("| decoder | base tok/fwd | jf tok/fwd |\n|---|---|---|")
  for (label, _), b, j in zip(METHODS, cols["base"], cols["jf"]):
    print(f"| {label} | {b:.2f} | {j:.2f} |")


if __name__ == "__main__":
  main()
