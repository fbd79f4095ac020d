"""Which Hugging Face tensor each paraflax parameter is, and how their layouts differ.

torch `Linear` weights are `[out, in]`; paraflax keeps `[in, out]` with the head axes split
(`wq [D, H, Dh]`, `wo [H, Dh, D]`). Every conversion here is a transpose and/or reshape, so
HF -> paraflax -> HF is bit-exact. One table drives both directions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# layouts: copy (same array), linear ([out, in] <-> [in, out]), in_heads ([H*Dh, D] <->
# [D, H, Dh]), out_heads ([D, H*Dh] <-> [H, Dh, D]), heads ([H*Dh] <-> [H, Dh])
_LAYER = {
    ("attn_norm", "scale"): ("input_layernorm.weight", "copy"),
    ("attn", "wq"): ("self_attn.q_proj.weight", "in_heads"),
    ("attn", "wk"): ("self_attn.k_proj.weight", "in_heads"),
    ("attn", "wv"): ("self_attn.v_proj.weight", "in_heads"),
    ("attn", "wo"): ("self_attn.o_proj.weight", "out_heads"),
    ("attn", "bq"): ("self_attn.q_proj.bias", "heads"),
    ("attn", "bk"): ("self_attn.k_proj.bias", "heads"),
    ("attn", "bv"): ("self_attn.v_proj.bias", "heads"),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", "copy"),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", "copy"),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", "copy"),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", "linear"),
    ("mlp", "w_up"): ("mlp.up_proj.weight", "linear"),
    ("mlp", "w_down"): ("mlp.down_proj.weight", "linear"),
}
_TOP = {
    ("embed",): ("model.embed_tokens.weight", "copy"),
    ("final_norm", "scale"): ("model.norm.weight", "copy"),
    ("lm_head",): ("lm_head.weight", "linear"),
}
# present in some checkpoints, recomputed rather than stored by paraflax
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Entry(NamedTuple):
  """One parameter: its paraflax path and shape, the HF name, shape and layout."""

  path: tuple
  shape: tuple[int, ...]
  hf_name: str
  hf_shape: tuple[int, ...]
  layout: str


def hf_name(path: tuple) -> tuple[str, str]:
  """(HF tensor name, layout) of a paraflax parameter path like ('layers', 0, 'attn', 'wq')."""
  path = tuple(path)
  if path in _TOP:
    return _TOP[path]
  if len(path) >= 3 and path[0] == "layers" and tuple(path[2:]) in _LAYER:
    name, layout = _LAYER[tuple(path[2:])]
    return f"model.layers.{int(path[1])}.{name}", layout
  raise KeyError(f"paraflax parameter {'.'.join(map(str, path))} has no Hugging Face name")


def hf_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
  """The HF shape of a paraflax parameter of `shape`."""
  if layout == "copy":
    return tuple(shape)
  if layout == "linear":
    return tuple(reversed(shape))
  if layout == "in_heads":  # [D, H, Dh] -> [H*Dh, D]
    return (shape[1] * shape[2], shape[0])
  if layout == "out_heads":  # [H, Dh, D] -> [D, H*Dh]
    return (shape[2], shape[0] * shape[1])
  if layout == "heads":  # [H, Dh] -> [H*Dh]
    return (shape[0] * shape[1],)
  raise ValueError(f"unknown layout {layout!r}")


def entry(path: tuple, shape: tuple[int, ...]) -> Entry:
  name, layout = hf_name(path)
  return Entry(tuple(path), tuple(shape), name, hf_shape(shape, layout), layout)


def to_paraflax(x: np.ndarray, e: Entry) -> np.ndarray:
  """HF array (shape `e.hf_shape`) -> paraflax layout (a view where numpy allows)."""
  if e.layout in ("copy", "heads"):
    return x.reshape(e.shape)
  return x.T.reshape(e.shape)  # linear, in_heads, out_heads


def to_hf(x: np.ndarray, e: Entry) -> np.ndarray:
  """paraflax array (shape `e.shape`) -> HF layout."""
  if e.layout in ("copy", "heads"):
    return x.reshape(e.hf_shape)
  return x.reshape(e.hf_shape[::-1]).T  # linear, in_heads, out_heads
