"""How well a TiDAR model's diffusion drafts agree with its own greedy AR, by offset in the block.

    python scripts/tidar_agreement.py checkpoints/tidar_continual runs/tidar@800 --json agree.json

Per weights (`DIR` or `DIR@STEP`): the AR-mode and diffusion-mode held-out losses (stdlib
validation, nats/token; the diffusion loss over the run's own block sizes), and for each block
size k the agreement of mask slot o (o = 0..k-1) with the model's greedy AR token at that
position: the greedy continuations of HumanEval prompts are scored teacher-forced in one forward
of TiDAR's training layout (`tidar.doubled` + `masks.tidar_train`), where a block's slots see the
clean tokens before it, as the draft block sees the committed prefix when decoding. Slot 0
predicts what the AR head predicts, so its agreement is the diffusion mode's shortfall alone.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paraflax.decoding.generate import generate
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.evaluation.quality import heldout_batches, heldout_metrics
from paraflax.model import masks
from paraflax.training import load_trained
from paraflax.training.objectives.tidar import doubled


def agreement(model, prompts, rows, lengths, k: int) -> np.ndarray:
  """[k]: fraction of mask slots at offset o whose argmax is the greedy token there, over the
  blocks that lie inside the greedy continuations (`rows` [B, L] right-padded prompt +
  continuation; `prompts` [B] prompt lengths, `lengths` [B] continuation lengths)."""
  b, l = rows.shape
  tokens, positions = doubled(jnp.asarray(rows), model.cfg.mask_token_id)
  mask = masks.tidar_train(l, jnp.full((b,), k, jnp.int32))
  logits = nnx.jit(lambda m, t, p, a: m(t, p, a)[0])(model, tokens, positions, mask)
  hit = np.asarray(jnp.argmax(logits[:, l:], -1) == jnp.asarray(rows))  # [B, L]
  pos = np.arange(l)
  start = pos // k * k  # each position's block start
  inside = ((start[None] >= np.asarray(prompts)[:, None])
            & (start[None] + k <= (np.asarray(prompts) + np.asarray(lengths))[:, None]))
  return np.array([hit[inside & (pos - start == o)[None]].mean() for o in range(k)])


def measure(spec: str, n_prompts: int, new_tokens: int, blocks, heldout) -> dict:
  workdir, _, step = spec.partition("@")
  model, tok, cfg = load_trained(workdir, int(step) if step else None)
  prompts = humaneval_prompts(tok.encode, n_prompts, 192)
  out = jax.device_get(generate(model, prompts, max_new_tokens=new_tokens, eos_id=tok.eos_id))
  width = max(map(len, prompts)) + new_tokens
  rows = np.zeros((len(prompts), width), np.int32)  # right-padded prompt + continuation
  for i, (p, r, n) in enumerate(zip(prompts, out.tokens, out.lengths)):
    rows[i, :len(p) + n] = list(p) + r[:n].tolist()
  plens = [len(p) for p in prompts]
  diff = heldout_metrics(model, heldout, "tidar", cfg.objective_args)
  return {"weights": spec, "ar_loss": heldout_metrics(model, heldout)["loss"],
          "diff_loss": diff["diff_loss"],
          "agreement": {k: agreement(model, plens, rows, out.lengths, k).round(3).tolist()
                        for k in blocks}}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("weights", nargs="+", help="TiDAR workdirs, DIR or DIR@STEP")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
  ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
  ap.add_argument("--json", help="write the rows here")
  args = ap.parse_args()
  rows = []
  heldout = None
  for spec in args.weights:
    if heldout is None:
      heldout = heldout_batches(load_trained(spec.partition("@")[0])[1])
    r = measure(spec, args.prompts, args.tokens, args.blocks, heldout)
    rows.append(r)
    agree = " | ".join(" / ".join(f"{a:.2f}" for a in r["agreement"][k]) for k in args.blocks)
    print(f"| {spec} | {r['ar_loss']:.3f} | {r['diff_loss']:.3f} | {agree} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
