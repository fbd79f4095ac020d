"""Hugging Face checkpoints (Llama, Qwen2/Qwen2.5, Qwen3): load and export.

    model = load_hf(dir)                 # config.json + *.safetensors -> Transformer
    tok = load_hf_tokenizer(dir)         # tokenizer.json; every EOS id, BOS, PAD, chat template
    export_hf(model, out_dir, tok)       # -> safetensors, configs, tokenizer files (bit-exact)
"""

from paraflax.hf.config import SUPPORTED, hf_config_from_model, model_config_from_hf
from paraflax.hf.export import export_hf
from paraflax.hf.load import load_hf
from paraflax.hf.tokenizer import encode_prompt, load_hf_tokenizer

__all__ = ["SUPPORTED", "encode_prompt", "export_hf",
           "hf_config_from_model", "load_hf", "load_hf_tokenizer", "model_config_from_hf"]

