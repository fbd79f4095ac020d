"""Tokens per forward of Jacobi's two variants (`Jacobi(16)`, paraflax's running window, and
`Jacobi(16, variant="released")`) on a workdir, in the released code's convention:
sum(T - 1) / sum(forwards), the prefill not counted; the first 6 HumanEval prompts as the bench
encodes them, 64 and 128 new tokens, the released variant over 5 seeds (its draws), every row
checked equal to greedy AR (docs/methods/jacobi.md).

    python scripts/jacobi_variants.py checkpoints/jacobi_forcing_r1
"""
import sys

import jax
import numpy as np

import paraflax as pf
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.loading import load_model


def main(workdir: str) -> None:
  model, tok, encode = load_model(workdir)
  prompts = humaneval_prompts(encode, 6, 192)
  for new in (64, 128):
    ar = pf.generate(model, prompts, max_new_tokens=new, eos_id=tok.eos_ids)
    for variant, seeds in (("window", [0]), ("released", range(5))):
      tpf = []
      for seed in seeds:
        out = pf.generate(model, prompts, decoder=pf.decoders.Jacobi(16, variant=variant),
                          max_new_tokens=new, eos_id=tok.eos_ids, rng=jax.random.key(seed))
        assert (np.asarray(out.tokens) == np.asarray(ar.tokens)).all(), "not greedy AR"
        tpf.append((np.asarray(out.lengths) - 1).sum() / np.asarray(out.forwards).sum())
      print(f"{workdir} new={new} {variant}: {np.mean(tpf):.3f} (seeds {len(tpf)}: "
            f"{np.round(tpf, 3).tolist()})", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
