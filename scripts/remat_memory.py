"""XLA temporaries of one jitted AR value_and_grad step per `RunControl.remat` policy,
with the layers unrolled (a Python loop) and scanned (`scan_layers=True`).

Abstract shapes only (nothing is allocated or run):
  python scripts/remat_memory.py [--d-model 512] [--layers 8] [--seq 2048] [--batch 1]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

import paraflax as pf
from paraflax.model.run import REMAT
from paraflax.training.objectives.ar import ar


def temp_bytes(cfg: pf.ModelConfig, run: pf.RunControl, batch: int, seq: int) -> int:
  graphdef, params = nnx.split(
      nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0), run=run)), nnx.Param)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def step(p, tokens):
    return jax.value_and_grad(lambda p: ar(nnx.merge(graphdef, p), {"tokens": tokens}, None)[0])(p)
  compiled = jax.jit(step).lower(params, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--d-model", type=int, default=512)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--dtype", default="float32")
  a = ap.parse_args()
  cfg = pf.ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers,
                       n_heads=a.heads, n_kv_heads=a.heads, d_ff=4 * a.d_model,
                       max_seq_len=a.seq, dtype=a.dtype)
  out = {"backend": jax.default_backend(), **vars(a)}
  for scan in (False, True):
    for remat in REMAT:
      b = temp_bytes(cfg, pf.RunControl(remat=remat, scan_layers=scan), a.batch, a.seq)
      out[f"temp_MiB_{'scan' if scan else 'loop'}_{remat}"] = round(b / 2**20, 1)
      print(f"scan_layers={scan!s:5s} remat={remat:13s} temp {b / 2**20:9.1f} MiB", flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
