"""Per-token time of the compiled AR loop vs a bare one-token forward (see issue 2).

  python scripts/ar_overhead.py
"""

from paraflax.evaluation.overhead import measure
from paraflax.model.config import ModelConfig

CFG = ModelConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768,
                  max_seq_len=1024)

if __name__ == "__main__":
  print(f"model: {CFG}")
  print(f"{'batch':>5} {'loop ms/token':>14} {'forward ms':>11} {'ratio':>6}")
  for batch in (1, 8):
    r = measure(CFG, batch=batch)
    print(f"{batch:>5} {r.loop_ms_per_token:>14.3f} {r.forward_ms:>11.3f} {r.ratio:>6.3f}")
