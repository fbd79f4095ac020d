"""paraflax prompt lookup vs transformers' `generate(prompt_lookup_num_tokens=...)` on the same
checkpoint and HumanEval prompts, measured in one run (issue 5).

  python scripts/compare_hf_prompt_lookup.py [--workdir DIR] [--prompts 16] [--new 64]

The paraflax model in DIR (default: the demo's tiny AR model) is exported to a Hugging Face
directory and loaded by transformers, so both libraries run the same weights. Forwards are
counted (prefill included) with a forward hook on the transformers side and from
`GenerateOutput` on ours; all four runs are greedy and must agree token for token.
"""

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

import paraflax as pf
from paraflax.evaluation.humaneval import humaneval_prompts
from paraflax.paths import CACHE
from paraflax.training import load_trained

jax.config.update("jax_default_matmul_precision", "highest")


def hf_run(model, prompts, new, **kw):
  calls = [0]
  hook = model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
  outs, seconds = [], 0.0
  with torch.no_grad():
    for p in prompts:
      ids = torch.tensor([p])
      t0 = time.perf_counter()
      out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           do_sample=False, pad_token_id=0, **kw)
      seconds += time.perf_counter() - t0
      outs.append(out[0, len(p):].tolist())
  hook.remove()
  return outs, calls[0], seconds


def pf_run(model, prompts, new, decoder, batch):
  outs, forwards, seconds = [], 0, 0.0
  for i in range(0, len(prompts), batch):
    chunk = prompts[i:i + batch]
    kw = dict(decoder=decoder, max_new_tokens=new, max_prompt_len=max(map(len, prompts)))
    jax.block_until_ready(pf.generate(model, chunk, **kw).tokens)  # warm (compiled once)
    t0 = time.perf_counter()
    out = jax.device_get(pf.generate(model, chunk, **kw))
    seconds += time.perf_counter() - t0
    outs += [r.tolist() for r in out.tokens]
    forwards += int(out.forwards.sum() + out.prefill_forwards.sum())
  return outs, forwards, seconds


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default=str(CACHE / "demo" / "tiny_ar"))
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--num-tokens", type=int, default=8)
  ap.add_argument("--ngram", type=int, default=2, help="transformers' default is 2")
  args = ap.parse_args()
  torch.set_num_threads(2)
  model, tok, _ = load_trained(args.workdir)
  prompts = humaneval_prompts(tok.encode, args.prompts, 192)
  hf_dir = Path(tempfile.mkdtemp()) / "hf"
  pf.export_hf(model, hf_dir, tokenizer=tok)
  hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  # like our runs (eos_id=None): EOS is an ordinary token, all runs generate `new` tokens
  # (min_new_tokens would instead forbid EOS and change the greedy output)
  hf.generation_config.eos_token_id = None
  n_tok = args.new * len(prompts)
  rows = []
  for name, run in [
      ("transformers greedy", lambda: hf_run(hf, prompts, args.new)),
      ("transformers prompt lookup", lambda: hf_run(
          hf, prompts, args.new, prompt_lookup_num_tokens=args.num_tokens,
          max_matching_ngram_size=args.ngram)),
      ("paraflax AR, batch 1", lambda: pf_run(model, prompts, args.new, pf.decoders.AR(), 1)),
      ("paraflax prompt lookup, batch 1", lambda: pf_run(
          model, prompts, args.new, pf.decoders.PromptLookup(args.ngram, args.num_tokens), 1)),
      ("paraflax AR, batch 8", lambda: pf_run(model, prompts, args.new, pf.decoders.AR(), 8)),
      ("paraflax prompt lookup, batch 8", lambda: pf_run(
          model, prompts, args.new, pf.decoders.PromptLookup(args.ngram, args.num_tokens), 8)),
  ]:
    outs, forwards, seconds = run()
    rows.append((name, outs, forwards, seconds))
  ref = rows[0][1]
  print(f"{len(prompts)} HumanEval prompts x {args.new} new tokens, greedy, "
        f"k={args.num_tokens}, n<={args.ngram}; model {model.cfg.d_model}d x "
        f"{model.cfg.n_layers} layers from {args.workdir}")
  print(f"{'run':<34} {'tok/fwd':>8} {'tok/s':>9} {'vs transformers greedy':>23} {'same tokens':>12}")
  base = n_tok / rows[0][3]
  for name, outs, forwards, seconds in rows:
    same = np.mean([a == b for a, b in zip(outs, ref)])
    print(f"{name:<34} {n_tok / forwards:>8.2f} {n_tok / seconds:>9.1f} "
          f"{n_tok / seconds / base:>22.2f}x {same:>12.2f}")


if __name__ == "__main__":
  main()
