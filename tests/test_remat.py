"""Per-layer remat and scanned layers (`RunControl.remat`, `scan_layers`): the same loss and
gradients as the plain model (AR, the AS-ARM query stream, a cached forward), the same
`generate` output; both are run control."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.model import masks
from paraflax.training import load_config
from paraflax.training.config.train import config_differences
from paraflax.training.objectives.ar import ar
from paraflax.training.objectives.asarm import asarm_loss
from conftest import MICRO, compiled_micro_model

# each policy, each layout, scan with and without remat (one compilation each); the plain
# model is the micro default ("auto": no remat, no scan)
VARIANTS = [dict(remat="full", scan_layers=False), dict(remat="full"),  # "auto" scans
            dict(scan_layers=True, remat="save_matmuls"),
            dict(scan_layers=True),
            dict(remat="full", remat_layers=1)]  # the first of two layers: unscanned


def variant(model, **settings):
  """`model`'s weights in a model with other run-control `settings` (remat, scan_layers)."""
  graphdef, state = nnx.split(model)
  other = nnx.eval_shape(lambda: pf.Transformer(model.cfg, rngs=nnx.Rngs(0),
                                                run=pf.RunControl(**settings)))
  return nnx.merge(nnx.graphdef(other), state)


def cached_loss(model, batch, rng):
  """A loss through a cache: 4 tokens after cached slots (the cache's k, v are read)."""
  del rng
  logits, kv = model(batch["tokens"][:, :4], batch["pos"], batch["mask"], batch["cache"])
  return jnp.mean(logits ** 2) + jnp.mean(kv.k * kv.v), {}


def batches():
  """(loss, batch) pairs, built inside the jitted step (no eager op-by-op compiles)."""
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, MICRO["vocab_size"])
  cache = pf.init_cache(pf.ModelConfig(**MICRO), 2, 6)
  kv = jax.random.normal(jax.random.key(2), cache.k.shape)
  cache = dataclasses.replace(cache, k=kv, v=kv[::-1], lengths=jnp.array([6, 3]))
  cached = {"tokens": tokens, "pos": jnp.broadcast_to(jnp.arange(6, 10), (2, 4)),
            "cache": cache, "mask": masks.decode(cache.lengths, cache.slots, 4)}
  return [(ar, {"tokens": tokens}), (asarm_loss, {"tokens": tokens}), (cached_loss, cached)]


def losses_and_grads(model):
  """(loss, grads) of the AR, AS-ARM (query stream) and cached losses, in one compilation."""
  graphdef, params = nnx.split(model, nnx.Param)

  @jax.jit
  def all_of(p):
    return [jax.value_and_grad(lambda p: f(nnx.merge(graphdef, p), batch,
                                           jax.random.key(3))[0])(p)
            for f, batch in batches()]
  return all_of(params)


@functools.cache
def two_stream():
  model = compiled_micro_model(two_stream=True)  # content stream: the AR and cached losses
  return model, losses_and_grads(model)


@pytest.mark.parametrize("settings", VARIANTS, ids=str)
def test_remat_and_scan_give_the_plain_loss_and_gradients(settings):
  model, plain = two_stream()
  got = losses_and_grads(variant(model, **settings))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), got, plain)


@pytest.mark.parametrize("settings", VARIANTS[:2], ids=str)
def test_generate_is_unchanged_by_remat_and_scan(settings):
  model = two_stream()[0]
  prompts = [[5, 9, 2], [7, 1, 1, 30, 4]]
  plain = pf.generate(model, prompts, max_new_tokens=8)
  other = pf.generate(variant(model, **settings), prompts, max_new_tokens=8)
  np.testing.assert_array_equal(other.tokens, plain.tokens)
  np.testing.assert_array_equal(other.lengths, plain.lengths)


@pytest.mark.fast
def test_remat_and_scan_are_run_control_and_a_bad_value_is_one_line():
  cfg = load_config("micro_ar")
  other = dataclasses.replace(cfg, run=pf.RunControl(remat="full", scan_layers=True))
  assert config_differences(cfg, other) == []  # a run may resume with other settings
  # the same parameter tree: checkpoints, HF load/export and sharding rules are unchanged
  def params(**settings):
    model = nnx.eval_shape(lambda: pf.Transformer(pf.ModelConfig(**MICRO), rngs=nnx.Rngs(0),
                                                  run=pf.RunControl(**settings)))
    return jax.tree.flatten_with_path(jax.tree.map(lambda a: a.shape, nnx.state(model)))
  assert params(remat="full", scan_layers=True) == params()
  with pytest.raises(ValueError, match=r"run.remat must be one of \['auto', 'none', "
                     r"'full', 'save_matmuls'\], got 'dots'"):
    pf.RunControl(remat="dots")
  with pytest.raises(ValueError, match="scan_layers must be True, False or 'auto', got 1"):
    pf.RunControl(scan_layers=1)
  with pytest.raises(ValueError, match=r"remat_layers must be an int >= 1 or None"):
    pf.RunControl(remat_layers=0)
  scanned = pf.Transformer(pf.ModelConfig(**MICRO), rngs=nnx.Rngs(0), run=pf.RunControl(
      remat="full", remat_layers=1, scan_layers=True))
  with pytest.raises(ValueError, match=r"scan_layers=True scans one layer program; "
                                       r"run.remat_layers=1 of 2 layers needs them unscanned"):
    scanned(jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], masks.causal(jnp.array([4]), 4))


@pytest.mark.fast
def test_auto_remats_and_scans_real_size_training_calls_only():
  small = pf.ModelConfig(**MICRO)
  # Qwen2.5-0.5B's layer shapes at 1024 tokens, bf16: ~0.9 GiB of activations per row
  real = dataclasses.replace(small, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                             d_ff=4864, max_seq_len=1024, dtype="bfloat16")
  auto = pf.RunControl()
  assert (auto.remat, auto.scan_layers) == ("auto", "auto")  # the defaults
  assert auto.remat_policy(small) == "none" and not auto.scans(small, cached=False)
  assert auto.remat_policy(real) == "full" and auto.scans(real, cached=False)
  assert not auto.scans(real, cached=True)  # decode steps never stack the weights
  assert pf.RunControl(remat="full").scans(small, cached=False)
  assert not pf.RunControl(scan_layers=False).scans(real, cached=False)
  # remat on the first k layers: the others keep everything, and the layers run unscanned
  some = pf.RunControl(remat="full", remat_layers=1)
  assert [some.layer_remat(small, i) for i in range(2)] == ["full", "none"]
  assert not some.scans(small, cached=False) and some.resolved(small, 16)["remat_layers"] == 1
  every = pf.RunControl(remat="full", remat_layers=2)  # every layer: as without the field
  assert every.scans(small, cached=False) and "remat_layers" not in every.resolved(small, 16)
