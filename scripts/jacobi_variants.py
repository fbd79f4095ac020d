"""Tokens per forward of the Jacobi decoders' two variants, paraflax's ("window") and the
released Jacobi Forcing code's ("released"), on a workdir, in the released code's convention:
sum(T - 1) / sum(forwards), the prefill not counted; the first 6 HumanEval prompts as the bench
encodes them, n = 16, 64 and 128 new tokens, every row checked equal to greedy AR
(docs/methods/jacobi.md). "jacobi": `Jacobi(16)` and `Jacobi(16, variant="released")`; "mr":
`JacobiMR(16, num_blocks=K, pool_size=4, ...)` at K = 1 and 2, paraflax's with 3 candidates,
the released one with its own rule. The released variants are the mean over 5 seeds (their
draws); paraflax's use no randomness (one run).

    python scripts/jacobi_variants.py checkpoints/jacobi_forcing_r1          # both parts
    python scripts/jacobi_variants.py checkpoints/jacobi_forcing_r1 mr 3     # MR, 3 seeds
"""
import sys

import jax
import numpy as np

import paraflax as pf
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.loading import load_model

N = 16


def decoders(part: str):
  """(label, decoder, randomised) of a part."""
  if part == "jacobi":
    return [(v, pf.decoders.Jacobi(N, variant=v), v == "released") for v in ("window", "released")]
  return [(f"MR K{k} pool4 {v}", pf.decoders.JacobiMR(
      N, num_blocks=k, pool_size=4, variant=v, num_candidates=3 if v == "window" else 0),
      v == "released") for k in (1, 2) for v in ("window", "released")]


def main(workdir: str, parts=("jacobi", "mr"), seeds: int = 5) -> None:
  model, tok, encode = load_model(workdir)
  prompts = humaneval_prompts(encode, 6, 192)
  for new in (64, 128):
    ar = pf.generate(model, prompts, max_new_tokens=new, eos_id=tok.eos_ids)
    for part in parts:
      for label, dec, randomised in decoders(part):
        tpf = []
        for seed in range(seeds) if randomised else [0]:
          out = pf.generate(model, prompts, decoder=dec, max_new_tokens=new, eos_id=tok.eos_ids,
                            rng=jax.random.key(seed))
          assert (np.asarray(out.tokens) == np.asarray(ar.tokens)).all(), "not greedy AR"
          tpf.append((np.asarray(out.lengths) - 1).sum() / np.asarray(out.forwards).sum())
        print(f"{workdir} new={new} {label}: {np.mean(tpf):.3f} (seeds {len(tpf)}: "
              f"{np.round(tpf, 3).tolist()})", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("jacobi", "mr"),
       int(sys.argv[3]) if len(sys.argv) > 3 else 5)
