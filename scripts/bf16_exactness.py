"""How many rows of greedy decoding agree across precisions, on the shipped tiny model.

  python scripts/bf16_exactness.py [--prompts 16] [--max-new-tokens 64]

Greedy exactness is token equality with a one-token-at-a-time AR run in float32 with
"highest" matmul precision; in bfloat16 a parallel decoder is exact with respect to its own
verifying forward, whose argmax can differ from AR's where the top-2 logits are near ties.
Prints rows equal (out of the prompts) for: fp32 Jacobi vs fp32 AR, bf16 AR vs fp32 AR and
bf16 Jacobi vs bf16 AR.
"""

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from paraflax import Transformer, decoders, generate
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.training import load_trained

TINY_AR = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny_ar"


def bf16(model):
  """The same weights as a bfloat16 model (bfloat16 params and compute; float32 logits)."""
  cfg = dataclasses.replace(model.cfg, dtype="bfloat16", param_dtype="bfloat16")
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  params = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), nnx.split(model, nnx.Param)[1])
  return nnx.merge(graphdef, params)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--max-new-tokens", type=int, default=64)
  args = p.parse_args()
  jax.config.update("jax_default_matmul_precision", "highest")
  fp32, tok, _ = load_trained(TINY_AR)
  prompts = humaneval_prompts(tok.encode, args.prompts, 192)
  run = lambda model, dec: np.asarray(generate(model, prompts, dec, args.max_new_tokens,
                                               eos_id=tok.eos_id).tokens)
  jacobi = decoders.Jacobi(block_size=16)
  ar32, ar16 = run(fp32, None), run(bf16(fp32), None)
  same = lambda a, b: f"{int((a == b).all(1).sum())}/{len(prompts)}"
  print(f"{len(prompts)} HumanEval prompts x {args.max_new_tokens} greedy tokens, "
        f"{jax.devices()[0].platform}; rows equal:")
  print(f"  fp32 Jacobi vs fp32 AR: {same(run(fp32, jacobi), ar32)}")
  print(f"  bf16 AR     vs fp32 AR: {same(ar16, ar32)}")
  print(f"  bf16 Jacobi vs bf16 AR: {same(run(bf16(fp32), jacobi), ar16)}")


if __name__ == "__main__":
  main()
