"""Shared test setup: float32 'highest' matmuls and micro models with well-separated logits."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import paraflax as pf

jax.config.update("jax_default_matmul_precision", "highest")

# Scale logits a little past the target std: recomputing the std after scaling may land a few
# ulps below it on another machine (FMA or not, other reduction order).
STD_MARGIN = 1 + 1e-4

MICRO = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
             max_seq_len=128)


def micro_model(seed: int = 0, logit_std: float = 3.0, **overrides) -> pf.Transformer:
  """A micro model whose logits have std >= 2, so greedy top-2 gaps are not near ties."""
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  model = pf.Transformer(cfg, rngs=nnx.Rngs(seed))
  tokens = jax.random.randint(jax.random.key(seed), (4, 16), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (4, 16))
  logits, _ = model(tokens, pos, pf.masks.causal(jnp.full((4,), 16), 16))
  scale = logit_std * STD_MARGIN / float(jnp.std(logits))
  if cfg.tie_embeddings:
    model.final_norm.scale[...] = model.final_norm.scale[...] * scale
  else:
    model.lm_head[...] = model.lm_head[...] * scale
  logits, _ = model(tokens, pos, pf.masks.causal(jnp.full((4,), 16), 16))
  assert float(jnp.std(logits)) >= 2.0
  return model


def compiled_micro_model(seed: int = 0, logit_std: float = 3.0, **overrides) -> pf.Transformer:
  """`micro_model` built in two compiled calls (init, one forward) instead of op by op, for
  subprocess tests where eager initialisation would dominate; identical on every process."""
  from paraflax.training.trainer import init_params
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  model = nnx.merge(*init_params(cfg, seed))
  tokens = jax.random.randint(jax.random.key(seed), (4, 16), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (4, 16))
  graphdef, params = nnx.split(model)
  std = jax.jit(lambda p: jnp.std(nnx.merge(graphdef, p)(
      tokens, pos, pf.masks.causal(jnp.full((4,), 16), 16))[0]))
  model.lm_head[...] = model.lm_head[...] * (logit_std * STD_MARGIN / std(params))
  assert float(std(nnx.split(model)[1])) >= 2.0
  return model


class StubTokenizer:
  """What a trajectory / teacher store keeps of the tokenizer of the model that made it."""

  def fingerprint(self):
    return "micro"

  def save(self, path):
    path.write_text("{}")


@pytest.fixture(scope="session")
def model():
  return micro_model()
