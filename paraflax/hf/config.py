"""Hugging Face `config.json` <-> `ModelConfig` for the Llama, Qwen2/Qwen2.5 and Qwen3 families.

Reads both the transformers 4 layout (`rope_theta`, `rope_scaling`) and the transformers 5
layout (`rope_parameters`), and refuses every feature the paraflax model does not compute
(sliding windows, biases other than Qwen2's q/k/v, other RoPE types, other activations), so
a checkpoint that loads is one whose logits match.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paraflax.json_io import read_json_object
from paraflax.model.config import ModelConfig, RopeScaling

SUPPORTED = ("llama", "qwen2", "qwen3")  # HF model_type values (Qwen2.5 is "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}  # transformers' defaults
_DTYPES = ("float32", "bfloat16", "float16")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The `config.json` of a local Hugging Face checkpoint directory, as a dict."""
  path = Path(path).expanduser()
  if not path.is_dir():
    raise FileNotFoundError(f"Hugging Face checkpoint directory {str(path)!r} not found")
  file = path / "config.json"
  if not file.is_file():
    raise FileNotFoundError(f"{str(file)!r} not found: {str(path)!r} is not a Hugging Face "
                            "checkpoint directory (expected config.json + *.safetensors)")
  return read_json_object(file)


def _unsupported(model_type: str) -> ValueError:
  return ValueError(
      f"unsupported Hugging Face architecture model_type={model_type!r}; supported: "
      "llama (Llama 1/2/3.x), qwen2 (Qwen2, Qwen2.5), qwen3 (dense Qwen3). Mixture-of-experts "
      "variants (qwen2_moe, qwen3_moe, ...) are not supported yet, nor are sliding-window "
      "models such as mistral")


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from either config layout."""
  params = hf.get("rope_parameters") or {}
  legacy = hf.get("rope_scaling") or {}
  if params and not isinstance(params.get("rope_theta", 0.0), (int, float)):
    raise ValueError("per-layer-type rope_parameters are not supported")
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  spec = {**legacy, **params}
  rope_type = spec.get("rope_type", spec.get("type", "default"))
  partial = spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ValueError(f"partial_rotary_factor={partial} is not supported (only full RoPE)")
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ValueError(f"RoPE scaling rope_type={rope_type!r} is not supported; supported: "
                     "'default' and 'llama3' (yarn, dynamic, linear, longrope, ... are not)")
  try:
    return theta, RopeScaling(
        factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]))
  except KeyError as e:
    raise ValueError(f"llama3 RoPE scaling is missing the field {e.args[0]!r}") from None


def _check_features(hf: dict[str, Any], model_type: str) -> None:
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act != "silu":
    raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
  if hf.get("attention_bias", False):
    raise ValueError(f"{model_type} with attention_bias=true (a bias on o_proj too) is not "
                     "supported")
  if hf.get("mlp_bias", False):
    raise ValueError("mlp_bias=true is not supported")
  layer_types = hf.get("layer_types") or []
  windowed = [i for i, t in enumerate(layer_types) if t != "full_attention"]
  if hf.get("use_sliding_window", False) or windowed:
    raise ValueError(f"sliding-window attention (use_sliding_window / layer_types "
                     f"{sorted(set(layer_types))}) is not supported: paraflax attends to every "
                     "earlier position")
  if hf.get("quantization_config"):
    raise ValueError("quantized checkpoints (quantization_config) are not supported")


def model_config_from_hf(hf: dict[str, Any], *, dtype: str | None = None,
                         param_dtype: str | None = None,
                         max_seq_len: int | None = None) -> ModelConfig:
  """The `ModelConfig` of a Hugging Face config dict.

  `dtype` (compute) defaults to the checkpoint's dtype, `param_dtype` to `dtype`, and
  `max_seq_len` to `max_position_embeddings`.
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED:
    raise _unsupported(str(model_type))
  _check_features(hf, model_type)
  theta, scaling = _rope(hf)
  try:
    d, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    vocab, n_layers, d_ff = (int(hf["vocab_size"]), int(hf["num_hidden_layers"]),
                             int(hf["intermediate_size"]))
  except KeyError as e:
    raise ValueError(f"config.json is missing the field {e.args[0]!r}") from None
  head_dim = hf.get("head_dim") or d // n_heads
  saved = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  dtype = dtype or (saved if saved in _DTYPES else "float32")
  return ModelConfig(
      vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), d_ff=d_ff,
      max_seq_len=int(max_seq_len or hf.get("max_position_embeddings")
                      or _MAX_POSITIONS[model_type]),
      head_dim=None if head_dim * n_heads == d else int(head_dim),
      rope_theta=theta, rope_scaling=scaling, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype, param_dtype=param_dtype or dtype)


def hf_model_type(cfg: ModelConfig) -> str:
  """The architecture that computes `cfg`: qwen3 if qk-norm, qwen2 if q/k/v bias, else llama."""
  if cfg.two_stream:
    raise ValueError("two_stream (AS-ARM query stream) models have no Hugging Face counterpart")
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("qk_norm together with qkv_bias has no Hugging Face counterpart (Qwen3's "
                     "attention_bias also adds an o_proj bias)")
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def hf_config_from_model(cfg: ModelConfig, *, bos_id: int | None = None,
                         eos_id: int | list[int] | None = None,
                         pad_id: int | None = None) -> dict[str, Any]:
  """A `config.json` dict that transformers (4.x and 5.x) loads as the same model (`eos_id`
  a list where several tokens end a text)."""
  model_type = hf_model_type(cfg)
  out: dict[str, Any] = {
      "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.dim_per_head, "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
      "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.param_dtype,
      "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
      "attention_dropout": 0.0, "use_cache": True,
  }
  if model_type == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False, sliding_window=None,
               max_window_layers=cfg.n_layers)
  if model_type == "qwen3":
    out["attention_bias"] = False
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    out["rope_scaling"] = {
        "rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings}
  return out
