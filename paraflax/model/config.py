"""Model configuration, what a model is: a frozen, hashable dataclass (variants via
`dataclasses.replace`). How a run computes it is `RunControl` (`run.py`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# run control, `RunControl`'s since schema 3: given to ModelConfig, a ValueError saying so;
# read from one, an AttributeError
MOVED = ("attention", "remat", "scan_layers", "loss_chunk")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 RoPE frequency scaling (`rope_type: "llama3"` in a Hugging Face config).

  Wavelengths below `original_max_position_embeddings / high_freq_factor` keep their
  frequency, those above `original_max_position_embeddings / low_freq_factor` are divided by
  `factor`, and the band between is interpolated smoothly (as transformers does).
  """

  rope_type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type != "llama3":
      raise ValueError(f"RopeScaling.rope_type {self.rope_type!r} is not supported; supported: "
                       "'llama3' (or rope_scaling=None for plain RoPE)")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
    if not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(f"RopeScaling needs high_freq_factor > low_freq_factor > 0, got "
                       f"{self.high_freq_factor} and {self.low_freq_factor}")
    if self.original_max_position_embeddings < 1:
      raise ValueError("RopeScaling.original_max_position_embeddings must be >= 1, got "
                       f"{self.original_max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama/Qwen-family decoder.

  `dtype` is the compute dtype (activations, attention); parameters are kept in
  `param_dtype` and logits are always float32. The run-control keywords of older versions
  (`MOVED`: attention, remat, scan_layers, loss_chunk) are a ValueError naming `RunControl`,
  and reading one is an AttributeError saying where it went.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  max_seq_len: int
  head_dim: int | None = None  # default d_model // n_heads
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None  # a mapping (e.g. from JSON) is converted
  rms_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2
  qk_norm: bool = False  # Qwen3
  tie_embeddings: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  mask_token_id: int | None = None  # required by diffusion-mode models (TiDAR, DEER drafter)
  sep_token_id: int | None = None  # DEER drafter: marks where the prefix ends and the block starts
  # DEER drafter: how its prefix attends, "causal" (cached while decoding) or "bidirectional"
  # (re-encoded at every draft); training and decoding both read it (`deer_layout.mask`)
  drafter_prefix: str = "causal"
  two_stream: bool = False  # AS-ARM query stream (ASSD)

  def __getattr__(self, name):  # only for names not found: no field, no class attribute
    if name in MOVED:
      raise AttributeError(f"ModelConfig.{name} moved to RunControl.{name} (TrainConfig.run)")
    raise AttributeError(f"'ModelConfig' object has no attribute {name!r}")

  def __post_init__(self):
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling, a mapping or None, "
                       f"got {self.rope_scaling!r}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                 "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                       f"({self.n_kv_heads}) for grouped-query attention")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(f"d_model ({self.d_model}) is not divisible by n_heads "
                       f"({self.n_heads}); set head_dim explicitly")
    if self.dim_per_head % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.dim_per_head}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, "
                         f"got {getattr(self, name)!r}")
    if self.drafter_prefix not in ("causal", "bidirectional"):
      raise ValueError(f"ModelConfig.drafter_prefix must be 'causal' or 'bidirectional', got "
                       f"{self.drafter_prefix!r}")
    if self.drafter_prefix == "bidirectional" and None in (self.mask_token_id, self.sep_token_id):
      raise ValueError("drafter_prefix='bidirectional' is a DEER drafter's setting: it needs "
                       "mask_token_id and sep_token_id")
    for name in ("mask_token_id", "sep_token_id"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(f"{name} {value} is outside the vocabulary [0, {self.vocab_size})")

  @property
  def dim_per_head(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def params_dtype(self):
    return _DTYPES[self.param_dtype]


def _refusing_moved(init):
  """`init` with `MOVED`'s keywords a ValueError when given (None is taken as not given)."""

  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    given = [name for name in MOVED if kwargs.pop(name, None) is not None]
    if given:
      raise ValueError(f"ModelConfig takes no {given[0]}: it is run control now, "
                       f"RunControl({given[0]}=...), given as TrainConfig(run=...), --set "
                       f"run.{given[0]}=... or Transformer(cfg, run=...)")
    init(self, *args, **kwargs)

  return __init__


# not fields (so `dataclasses.replace` and reading them know nothing of them): keywords only
ModelConfig.__init__ = _refusing_moved(ModelConfig.__init__)
