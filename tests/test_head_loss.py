"""Chunked head losses (`head_loss.py`, `RunControl.loss_chunk`): every objective's loss,
metrics and gradients with a chunk that does not divide the row equal the whole-row path, and
the chunked step's temporaries stay far below the full-logits figure at a large vocabulary."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.training import get_objective, load_config
from paraflax.training.config.overrides import apply_overrides
from paraflax.training.config.train import config_differences
from paraflax.training.objectives import head_loss
from paraflax.training.objectives import jacobi_forcing as jf
from conftest import MICRO

pytestmark = pytest.mark.fast


def _params(**overrides):
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  return nnx.split(pf.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def _graphdef(run: pf.RunControl, **overrides):
  """The graphdef of a model config computed as `run` says, built abstractly (nothing
  computed)."""
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  return nnx.split(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0), run=run)),
                   nnx.Param)[0]


def _teacher_rows():
  tokens = np.random.default_rng(0).integers(4, 48, (3, 14)).astype(np.int32)
  return {"tokens": jnp.asarray(tokens), "prompt_lens": jnp.array([2, 5, 3], jnp.int32),
          "lengths": jnp.array([14, 9, 12], jnp.int32)}


def _jacobi_rows():
  r = np.random.default_rng(1)
  rows = []
  for p in (3, 5):  # unequal prompts: pairs sit at other offsets in each row
    clean = r.integers(4, 48, (2, 3))
    noisy = np.where(r.random((2, 3)) < 0.5, clean, r.integers(4, 48, (2, 3)))
    rows.append(jf.example(r.integers(4, 48, p), noisy, clean, 19))
  return {k: jnp.asarray(np.stack([a[k], b[k]])) for k, (a, b) in
          ((k, (rows[0], rows[1])) for k in rows[0])}


TOKENS = {"tokens": jnp.asarray(np.random.default_rng(2).integers(0, 48, (2, 13)), jnp.int32)}
CASES = {  # name: (objective args, model overrides, batch)
    "ar": ({}, {}, {**_teacher_rows()}),
    "tidar": ({"block_size": [2, 4]}, {"mask_token_id": 2}, TOKENS),
    "asarm": ({}, {"two_stream": True}, {**TOKENS, "step": jnp.array([7, 7])}),
    "jacobi_forcing": ({}, {}, _jacobi_rows()),
    "jacobi_forcing_hard": ({"consistency": "hard"}, {}, _jacobi_rows()),
    "deer_stage1": ({}, {"mask_token_id": 2, "sep_token_id": 3}, _teacher_rows()),
    "deer_stage2": ({"blocks": 2, "max_masked": 4}, {"mask_token_id": 2, "sep_token_id": 3},
                    _teacher_rows()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_loss_and_gradients_equal_the_whole_row(name):
  args, overrides, batch = CASES[name]
  loss_fn = get_objective(name.removesuffix("_hard"), args)
  graphdef, params = _params(**overrides)
  chunked = _graphdef(pf.RunControl(loss_chunk=5), **overrides)

  @jax.jit
  def run(p):
    def value(g):
      return jax.value_and_grad(lambda q: loss_fn(nnx.merge(g, q), batch, jax.random.key(3)),
                                has_aux=True)(p)
    return value(graphdef), value(chunked)

  ((loss, metrics), grads), ((loss_c, metrics_c), grads_c) = run(params)
  np.testing.assert_allclose(loss_c, loss, rtol=1e-5)
  for k in metrics:
    np.testing.assert_allclose(metrics_c[k], metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
  for g, gc in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c)):
    scale = float(jnp.abs(g).max()) + 1e-12
    np.testing.assert_allclose(gc / scale, g / scale, atol=1e-5)


def test_chunked_step_temporaries_are_far_below_the_full_logits():
  """AR at vocab 65536, 256 positions: logits [1, 256, V] float32 are 64 MiB; chunks of 16
  positions hold a sixteenth of them (what remains: the [V, D] head and its gradients)."""
  cfg = pf.ModelConfig(**{**MICRO, "vocab_size": 65536, "max_seq_len": 256})
  batch = {"tokens": jax.ShapeDtypeStruct((1, 256), jnp.int32)}
  loss_fn = get_objective("ar")

  def temp(run):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0),
                                                                       run=run)))
    grad = jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b, None)[0])
    return jax.jit(grad).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  full, chunked = temp(pf.RunControl()), temp(pf.RunControl(loss_chunk=16))
  assert full > 2 * 64 * 2**20  # logits and their gradient
  assert chunked < 0.2 * full, (chunked, full)


def test_auto_chunk_takes_the_row_while_logits_are_small():
  assert head_loss.chunk_size(None, 8, 256, 512) == 256  # demo shapes: one pass
  assert head_loss.chunk_size(None, 1, 4096, 151936) == 410  # 10 chunks of <= 256 MiB
  assert head_loss.chunk_size(7, 2, 5, 48) == 5
  with pytest.raises(ValueError, match="loss_chunk must be an int >= 1 or None"):
    pf.RunControl(loss_chunk=0)


def test_loss_chunk_is_run_control_and_settable():
  cfg = load_config("micro_ar")
  other = apply_overrides(cfg, {"run.loss_chunk": "64"})
  assert other.run.loss_chunk == 64 and config_differences(cfg, other) == []
  old = cfg.to_dict()
  del old["run"]["loss_chunk"]  # a config saved before the setting existed
  assert pf.training.TrainConfig.from_dict(old) == cfg
