"""`make_random_hf_model`: a random-weight Hugging Face checkpoint, saved by transformers, to
try the bring-your-own-model commands offline (and the tests' fixture).

Qwen2 at a tiny shape or at Qwen2.5-0.5B's (`SHAPES`), with a byte-level BPE trained on a few
standard-library files, Qwen's special tokens and its ChatML chat template (EOS: `<|im_end|>`
and `<|endoftext|>`, as Qwen2.5-Instruct lists them). Its tokenizer files are the ones
`export_hf` writes (`write_tokenizer_files`, with the `auto_map`), so that transformers'
`AutoTokenizer` encodes as tokenizer.json does. Needs transformers and torch (the dev extra).
The weights are random: the figures it gives are of cost and memory, and every decoder's
output equals greedy AR's.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>")  # Qwen's, ids 0-3
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=True, torch_dtype="float32"),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1e6,
                         tie_word_embeddings=True, vocab_size=151936, torch_dtype="bfloat16"),
}


def random_tokenizer(vocab_size: int, max_files: int = 40):
  """A byte-level BPE (`tokenizers.Tokenizer`) of `vocab_size` ids trained on `max_files`
  stdlib files, Qwen's specials first."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from paraflax.data.corpus import stdlib_documents
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(stdlib_documents("train", max_files=max_files), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  return tok


def make_random_hf_model(out_dir: str | os.PathLike, shape: str = "tiny", *,
                         vocab_size: int = 1024, seed: int = 0, max_files: int = 40) -> Path:
  """Write a random Qwen2 of `shape` (a key of `SHAPES`) into `out_dir`: weights, config, a
  tokenizer of `vocab_size` ids (embedding rows: as many, or the shape's own vocabulary), its
  chat template and generation config; return the directory."""
  import torch
  import transformers

  from paraflax.data.tokenizer import Tokenizer
  from paraflax.hf.export import write_tokenizer_files
  out = Path(out_dir)
  tok = random_tokenizer(vocab_size, max_files)
  eos, end = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
  dims = dict(SHAPES[shape])
  dtype = getattr(torch, dims.pop("torch_dtype"))
  dims.setdefault("vocab_size", tok.get_vocab_size())
  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(**dims, eos_token_id=[eos, end], pad_token_id=end,
                                 bos_token_id=None)
  transformers.Qwen2ForCausalLM(cfg).to(dtype).save_pretrained(out)
  roles = Tokenizer(tok, special_tokens={"pad": "<|endoftext|>"}, eos_ids=[eos, end],
                    chat_template=CHATML, encode_special_tokens=False)
  write_tokenizer_files(out, roles, cfg.max_position_embeddings)
  return out
