"""Peak host memory and time of `load_hf` / `convert_hf` on a few-hundred-MB random checkpoint.

    python scripts/hf_memory.py [--dir /tmp/hf_memory] [--layers 4] [--dtype float32]

Writes a Qwen2-shaped random checkpoint with transformers (once; reused when present), then
measures each step in a fresh subprocess: peak RSS (VmHWM, else `ru_maxrss`) above the peak after imports,
relative to the safetensors bytes on disk. Needs torch + transformers (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
             num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)


def build(path: Path, layers: int) -> None:
  import tokenizers
  import torch
  import transformers
  cfg = transformers.Qwen2Config(**SHAPE, num_hidden_layers=layers)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(cfg).float()
  model.save_pretrained(path)
  vocab = {f"w{i}": i for i in range(SHAPE["vocab_size"])}
  tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")).save(
      str(path / "tokenizer.json"))


_MEASURE = r"""
import json, resource, sys, time
def peak_mb():
  # VmHWM is this process's own peak; ru_maxrss also counts the parent's at fork on Linux
  try:
    for line in open("/proc/self/status"):
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import jax, jax.numpy as jnp
import paraflax as pf
import orbax.checkpoint, paraflax.training  # imported before the baseline: library code, not data
jnp.zeros(1).block_until_ready()
base = peak_mb()
t0 = time.perf_counter()
step, src, out, dtype = sys.argv[1:5]
if step == "load":
  model = pf.load_hf(src, dtype=dtype)
  from flax import nnx
  jax.block_until_ready(nnx.state(model))
elif step == "convert":
  pf.convert_hf(src, out, dtype=dtype)
elif step == "safetensors_load_file":  # reference: the whole checkpoint read at once
  from safetensors.numpy import load_file
  from pathlib import Path
  tensors = {k: v for f in sorted(Path(src).glob("*.safetensors")) for k, v in load_file(f).items()}
print(json.dumps({"base_mb": base, "peak_mb": peak_mb(), "seconds": time.perf_counter() - t0}))
"""


def measure(step: str, src: Path, out: Path, dtype: str) -> dict:
  res = subprocess.run([sys.executable, "-c", _MEASURE, step, str(src), str(out), dtype],
                       capture_output=True, text=True, check=True)
  return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dir", default="/tmp/hf_memory")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--build", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.build:
    return build(Path(args.build), args.layers)
  root = Path(args.dir)
  src = root / f"qwen2-{args.layers}l"
  if not (src / "config.json").is_file():
    t0 = time.perf_counter()  # in a child, so this process stays small
    subprocess.run([sys.executable, __file__, "--build", str(src), "--layers", str(args.layers)],
                   check=True)
    print(f"built {src} in {time.perf_counter() - t0:.1f}s")
  disk_mb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**20
  print(f"checkpoint: {disk_mb:.0f} MiB of safetensors in {src}")
  for step in ("load", "convert", "safetensors_load_file"):
    out = root / f"converted-{time.time_ns()}"
    r = measure(step, src, out, args.dtype)
    extra = r["peak_mb"] - r["base_mb"]
    print(f"{step:>22}: peak RSS {r['peak_mb']:.0f} MiB, after imports {r['base_mb']:.0f} MiB, "
          f"added {extra:.0f} MiB = {extra / disk_mb:.2f}x the checkpoint, "
          f"{r['seconds']:.1f}s")
    if out.exists():
      import shutil
      shutil.rmtree(out)


if __name__ == "__main__":
  main()
