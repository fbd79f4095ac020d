"""The GPU decode kernel (`model/decode_attention.py`), run interpreted on this CPU: it equals
the dense path for every decode mask (one row, a causal block, candidate blocks; grouped heads
that are not a power of two; steps wider than one program's tile), reads the layer it is given
of the stacked cache, and a model that runs it decodes AR's and Jacobi's tokens. Its GPU
compile is in tests/test_compile.py, the rule that picks it in tests/test_attention.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.model import attention, decode_attention, decode_layer, mask_structure, masks
from paraflax.model.decode_attention import BLOCK_K, decode_attend
from paraflax.model.run import RunControl
from paraflax.perf.shapes import model_config

# 150 slots: three blocks of the kernel's loop, the last ending past the cache (masked loads);
# rows filled to 5, 20 and 149 read one, one and three of them
LAYERS, SLOTS = 3, 150


def _inputs(b, t, h, hkv, d=16, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  cache = [jax.random.normal(k[i], (LAYERS, b, SLOTS, hkv, d)) for i in (0, 1)]
  q = jax.random.normal(k[2], (b, t, h, d))
  chunk = [jax.random.normal(k[i], (b, t, hkv, d)) for i in (3, 4)]
  return q, *chunk, *cache


MASKS = {
    "one row": lambda lengths, t: masks.decode(lengths, SLOTS, 1),
    "causal block": lambda lengths, t: masks.decode(lengths, SLOTS, t),
    "candidate blocks": lambda lengths, t: mask_structure.decode_candidates(
        lengths, SLOTS, 4, 4, (t - 4) // 4).dense(),
    "a row without keys": lambda lengths, t: masks.decode(lengths, SLOTS, t).at[:, 1].set(False),
}


@pytest.mark.parametrize("heads", [pytest.param((14, 2), marks=pytest.mark.fast), (8, 4)],
                         ids=["G=7", "G=2"])
@pytest.mark.parametrize("name,t", [("one row", 1), ("causal block", 20),
                                    ("candidate blocks", 12), ("a row without keys", 3)])
def test_the_kernel_equals_the_dense_path(name, t, heads):
  """float32, "highest": every row, each seeing its cache prefix and its chunk keys as the
  mask says (row 2 a full cache but its spare slot), the kernel reading only the cache
  blocks a row's step sees. A query that sees nothing (a padding query: its output is never
  read) gets a mean of values, finite: the dense path's of every value, the kernel's of those
  it read."""
  h, hkv = heads
  q, k, v, cache_k, cache_v = _inputs(3, t, h, hkv)
  lengths = jnp.array([5, 20, SLOTS - 1])
  mask = MASKS[name](lengths, t)
  with jax.default_matmul_precision("highest"):
    for layer in (0, LAYERS - 1):
      want = attention._dense(q, k, v, mask, (cache_k[layer], cache_v[layer]))
      # rows 0 and 1 see slots below 20 only: their blocks past the first are never read
      unread = [c.at[:, :2, BLOCK_K:].set(jnp.nan) for c in (cache_k, cache_v)]
      got = decode_attend(q, k, v, mask, *unread, layer, interpret=True)
      sees = mask.any(-1)  # [B, T]
      np.testing.assert_allclose(got[sees], want[sees], rtol=1e-5, atol=1e-5)
      assert np.isfinite(got).all()


def greedy_tokens(cfg, logit_scale: float = 1.0, decoders=None,
                  settings=("xla", "gpu_decode")) -> dict:
  """{(attention setting, decoder name): tokens} of greedy AR and Jacobi (or `decoders`) on
  right-padded prompts, float32 "highest", for each attention setting (dense xla and
  "gpu_decode") on the same weights (the final norm's scale times `logit_scale`: logits that
  far apart have no near ties)."""
  prompts = np.asarray(jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size))
  lengths = np.array([12, 7])
  tokens = {}
  with jax.default_matmul_precision("highest"):
    for setting in settings:
      model = pf.Transformer(cfg, rngs=nnx.Rngs(0), run=RunControl(attention=setting))
      scale = model.final_norm.scale
      scale[...] = scale[...] * logit_scale
      for decoder in decoders or (pf.decoders.AR(), pf.decoders.Jacobi(4)):
        out = pf.generate(model, prompts, decoder, max_new_tokens=10, prompt_lengths=lengths)
        tokens[setting, type(decoder).__name__] = np.asarray(out.tokens)
  return tokens


def test_a_model_running_the_kernel_decodes_the_dense_path_tokens():
  """Greedy AR and Jacobi, float32, on right-padded prompts: token for token. Heads of 16:
  the attention kernel takes them, the decode layer does not (RoPE halves of 8), so the
  kernel runs inside the model's own layer."""
  cfg = dataclasses.replace(model_config("micro", "float32"), d_model=64)
  assert decode_attention.supports(cfg.dim_per_head)
  assert not decode_layer.runs(cfg, (2, 1, cfg.d_model), True, 1, "gpu_decode", "cpu")
  tokens = greedy_tokens(cfg)
  for name in ("AR", "Jacobi"):
    np.testing.assert_array_equal(tokens["gpu_decode", name], tokens["xla", name])
