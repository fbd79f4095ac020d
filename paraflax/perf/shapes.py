"""The model shapes perf measures (`--shape`), and random models of them."""

from __future__ import annotations

SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         d_ff=4864, max_seq_len=32768, qkv_bias=True, tie_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       d_ff=18944, max_seq_len=32768, qkv_bias=True, tie_embeddings=False),
    # the demo family's AR model at GPU scale (~21M parameters with the 2048-id tokenizer)
    "demo-21m": dict(vocab_size=2048, d_model=512, n_layers=6, n_heads=8, n_kv_heads=4,
                     d_ff=1536, max_seq_len=1024, tie_embeddings=True),
    "micro": dict(vocab_size=2048, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=1024, qkv_bias=True, tie_embeddings=True),
}
# the architecture fields of a shape (what a recipe's model is resized to)
ARCHITECTURE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


def shape_fields(shape: str, layers: int | None = None) -> dict:
  """`SHAPES[shape]` with `layers` layers (None: the shape's); an unknown shape is one line."""
  if shape not in SHAPES:
    raise ValueError(f"unknown shape {shape!r}: pick one of {', '.join(SHAPES)}")
  return {**SHAPES[shape], **({"n_layers": layers} if layers else {})}


def model_config(shape: str, dtype: str, layers: int | None = None, **extra):
  """A `ModelConfig` of `shape` with compute and parameters in `dtype`, `<mask>` = 2 (TiDAR
  runs on it), and `extra` fields (`two_stream`, ...)."""
  from paraflax.model.config import ModelConfig
  return ModelConfig(**{**shape_fields(shape, layers), "dtype": dtype, "param_dtype": dtype,
                        "mask_token_id": 2, **extra})


def random_model(cfg, seed: int = 0, attention: str | None = None):
  """A Transformer of `cfg` with random weights (`init_params`: two compiled programs
  whatever the depth), its attention `attention` (None: "auto")."""
  from flax import nnx

  from paraflax.model.run import RunControl
  from paraflax.training.run.step import init_params
  return nnx.merge(*init_params(cfg, seed, run=RunControl(attention=attention or "auto")))
