"""A random-weight Hugging Face checkpoint to try the bring-your-own-model commands offline
(`paraflax.hf.random_model.make_random_hf_model`: Qwen2, a byte-level BPE, ChatML).

    python scripts/random_hf_model.py runs/random_qwen                        # tiny, 2 layers
    python scripts/random_hf_model.py /tmp/q05 --shape qwen2.5-0.5b           # 494M, bf16

Needs transformers and torch (the dev extras).
"""

import argparse

from paraflax.hf.random_model import SHAPES, make_random_hf_model


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("out")
  p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  p.add_argument("--vocab-size", type=int, default=1024, help="tokenizer ids")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args()
  print(f"wrote {make_random_hf_model(a.out, a.shape, vocab_size=a.vocab_size, seed=a.seed)}")


if __name__ == "__main__":
  main()
