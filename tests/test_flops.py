"""Training FLOPs (`training/run/flops.py`): each objective's attention pairs equal its mask's
True count (averaged over the layouts its loss draws), the whole count equals a hand count and
XLA's cost analysis of the real loss, and the device peaks / MFU helpers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.decoding import deer_layout
from paraflax.devices import peak_flops
from paraflax.model import masks
from paraflax.training import objective
from paraflax.training.objectives import asarm, deer
from paraflax.training.objectives import jacobi_forcing as jf
from paraflax.training.run import flops
from paraflax.training.run.flops import (
  comparison_flops_per_token,
  forward_flops,
  mfu,
  objective_work,
  param_count,
  speed,
  tflops_per_device,
  train_flops,
)

CFG = pf.ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                     max_seq_len=128, mask_token_id=2, sep_token_id=3)
MASK, SEP = 2, 3


def pairs(name, seq_len, cfg=CFG, prompt_len=0, **args):
  return objective_work(cfg, name, seq_len, args, prompt_len=prompt_len).pairs


@pytest.mark.fast
def test_device_peaks_and_mfu():
  assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989e12
  assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert peak_flops("TPU v5 lite") == 197e12 and peak_flops("TPU v5") == 459e12
  assert peak_flops("TPU v6 lite") == 918e12
  assert peak_flops("cpu") is None and peak_flops() is None  # this CPU
  assert not hasattr(flops, "peak_flops")  # read from `devices`, not re-exported here
  assert tflops_per_device(8e12, 2.0, devices=2) == 2.0
  assert mfu(989e12, 1.0, 1, 989e12) == 1.0 and mfu(1e12, 1.0, 1, None) is None
  # the log's fields at a step rate: 4e12 FLOPs per step, 2 steps/s, 2 devices
  assert speed(4e12, 2.0, devices=2) == {"tflops_per_device": 4.0, "mfu": None}
  assert speed(4e12, 2.0, 2, peak=8e12) == {"tflops_per_device": 4.0, "mfu": 0.5}
  assert speed(None, 2.0, 2, peak=8e12) == {"tflops_per_device": None, "mfu": None}


@pytest.mark.fast
@pytest.mark.parametrize("extra", [{}, dict(tie_embeddings=True, qkv_bias=True),
                                   dict(qk_norm=True, head_dim=24, two_stream=True)])
def test_param_count_is_the_models(extra):
  cfg = dataclasses.replace(CFG, **extra)
  model = nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0)))
  assert param_count(cfg) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # the lookup alone
  assert param_count(cfg, embedding=False) == param_count(cfg) - table


@pytest.mark.fast
def test_ar_count_by_hand():
  """2 layers, B = 3 rows of T = 5: every matmul of the forward listed as 2 m k n."""
  cfg = dataclasses.replace(CFG, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=40)
  t, d, dh = 5, 32, 8
  per_layer = (2 * t * d * 4 * dh  # q
               + 2 * (2 * t * d * 2 * dh)  # k, v
               + 2 * 15 * dh * 4 * 2  # scores + weighted values over 15 causal pairs, 4 heads
               + 2 * t * 4 * dh * d  # o
               + 3 * (2 * t * d * 48))  # gate, up, down
  head = 2 * (t - 1) * d * 40
  assert train_flops(cfg, "ar", 3, t) == 3 * 3 * (2 * per_layer + head)


@pytest.mark.fast
def test_ar_and_tidar_pairs_are_their_masks():
  assert pairs("ar", 9) == masks.causal(jnp.array([9]), 9).sum()
  per_size = [int(masks.tidar_train(10, jnp.array([b])).sum()) for b in (3, 4)]
  assert pairs("tidar", 10, block_size=[3, 4]) == np.mean(per_size)  # sizes drawn uniformly


@pytest.mark.fast
@pytest.mark.parametrize("prompt,blocks,n", [(5, 3, 4), (2, 2, 6)])
def test_jacobi_forcing_pairs_are_its_mask(prompt, blocks, n):
  length = prompt + 2 * blocks * n
  row = jf.example(np.arange(prompt) + 4, np.full((blocks, n), 5), np.full((blocks, n), 6), length)
  mask = masks.noise_aware(jnp.asarray(row["kinds"])[None], jnp.asarray(row["valid"])[None])
  assert pairs("jacobi_forcing", length, prompt_len=prompt) == mask.sum()
  # the objective's own prompt_len (the rows' prompt region), where given
  assert objective_work(CFG, "jacobi_forcing", length, {"prompt_len": prompt}).pairs == mask.sum()
  # the head projects each slot once: soft consistency's teacher logits are the clean slots'
  for consistency in ("soft", "hard"):
    args = {"prompt_len": prompt, "consistency": consistency}
    assert objective_work(CFG, "jacobi_forcing", length, args).head_rows == length


@pytest.mark.fast
def test_asarm_pairs_are_its_lattice_masks():
  cfg, n = dataclasses.replace(CFG, two_stream=True), 16

  def lattice_pairs(rates):
    visible = asarm.lattice_visible(jax.random.key(0), jnp.asarray(rates), n)
    content, query = masks.lattice(visible)
    return (content.sum((1, 2)) + query.sum((1, 2))).mean()

  assert pairs("asarm", n, cfg, rate_end=(0.3, 0.3)) == lattice_pairs([0.3])
  # a range: the mean over the rates the objective's sampler spreads over it
  rates = asarm.low_discrepancy_rates(jax.random.key(1), 4096, 0.1, 0.9)
  np.testing.assert_allclose(pairs("asarm", n, cfg, rate_end=(0.1, 0.9)), lattice_pairs(rates),
                             rtol=2e-3)


def _deer1_mask_pairs(w, prompt, bidirectional):
  """Mean mask True count of Stage I rows over every cut (full rows)."""
  cuts = np.arange(prompt, w)  # prefix = prompt + u, u uniform in 0..A-1
  rows = deer.layout(jnp.zeros((len(cuts), w), jnp.int32), jnp.full((len(cuts),), w),
                     jnp.asarray(cuts), SEP)
  mask = deer_layout.mask(rows["kinds"], rows["blocks"], rows["valid"], bidirectional)
  return float(mask.sum((1, 2)).mean())


def _deer2_mask_pairs(w, prompt, max_masked, prefix_BxN, r_BxN, bidirectional):
  """Mask True count per batch row of Stage II rows at these draws (full rows)."""
  b = prefix_BxN.shape[0]
  batch = {"tokens": jnp.zeros((b, w), jnp.int32), "prompt_lens": jnp.full((b,), prompt),
           "lengths": jnp.full((b,), w)}
  rows = deer.stage2_rows(batch, jnp.asarray(prefix_BxN), jnp.asarray(r_BxN), max_masked, MASK,
                          SEP, 1.0, bidirectional)
  sums = deer_layout.mask(rows["kinds"], rows["blocks"], rows["valid"], bidirectional).sum((1, 2))
  return np.asarray(sums).reshape(b, -1).sum(1)  # bidirectional: N rows per batch row


@pytest.mark.parametrize("prefix_mode", ["causal", pytest.param("bidirectional",
                                                                 marks=pytest.mark.fast)])
def test_deer_pairs_are_their_masks_over_every_draw(prefix_mode):
  cfg = dataclasses.replace(CFG, drafter_prefix=prefix_mode)
  bidi = prefix_mode == "bidirectional"
  w, prompt, mm = 12, 3, 4
  np.testing.assert_allclose(pairs("deer_stage1", w, cfg, prompt),
                             _deer1_mask_pairs(w, prompt, bidi))
  # Stage II, one block: every (R, cut) with its probability (R uniform, then the cut)
  answer = w - prompt
  draws = [(prompt + u, r, 1 / mm / (answer - r + 1)) for r in range(1, mm + 1)
           for u in range(answer - r + 1)]
  prefix, r, p = (np.array(x) for x in zip(*draws))
  sums = _deer2_mask_pairs(w, prompt, mm, prefix[:, None], r[:, None], bidi)
  np.testing.assert_allclose(pairs("deer_stage2", w, cfg, prompt, max_masked=mm, blocks=1),
                             (sums * p).sum())
  # N blocks per row add up: a row's count is the sum of its blocks' (clean part once)
  prefix3, r3 = np.array([[5, 3, 8]]), np.array([[2, 4, 1]])
  alone = [_deer2_mask_pairs(w, prompt, mm, prefix3[:, [i]], r3[:, [i]], bidi)[0] for i in range(3)]
  clean = 0 if bidi else w * (w + 1) // 2  # shared layout: the clean tokens are counted once
  assert _deer2_mask_pairs(w, prompt, mm, prefix3, r3, bidi)[0] == sum(alone) - 2 * clean
  np.testing.assert_allclose(
      pairs("deer_stage2", w, cfg, prompt, max_masked=mm, blocks=3) - clean,
      3 * (pairs("deer_stage2", w, cfg, prompt, max_masked=mm, blocks=1) - clean))


def _batch(name, b, length, prompt):
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 256, (b, length)), jnp.int32)
  if name == "jacobi_forcing":
    blocks = (length - prompt) // 12
    row = jf.example(np.arange(prompt) + 4, np.full((blocks, 6), 5), np.full((blocks, 6), 6),
                     length)
    return {k: jnp.asarray(np.stack([v] * b)) for k, v in row.items()}
  if name.startswith("deer"):
    return {"tokens": tokens, "prompt_lens": jnp.full((b,), prompt),
            "lengths": jnp.full((b,), length)}
  if name == "asarm":
    return {"tokens": tokens, "step": jnp.zeros((b,), jnp.int32)}
  return {"tokens": tokens}


def _xla_flops(name, args, batch, grad: bool, compiled: bool = False):
  cfg = dataclasses.replace(CFG, two_stream=name == "asarm")
  graphdef, params = nnx.split(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)
  loss = objective(name).bind(args)

  def f(p):
    return loss(nnx.merge(graphdef, p), batch, jax.random.key(0))[0]
  lowered = jax.jit(jax.value_and_grad(f) if grad else f).lower(params)
  return cfg, (lowered.compile() if compiled else lowered).cost_analysis()["flops"]


def _dense(cfg, name, length, args, prompt):
  """The count with every (query, key) pair: what dense XLA attention computes."""
  work = objective_work(cfg, name, length, args, prompt_len=prompt)
  return forward_flops(cfg, dataclasses.replace(work, pairs=work.rows * work.kv_rows))


@pytest.mark.fast
def test_ar_forward_matches_xla_cost_analysis():
  """The compiled AR loss's FLOPs (dense attention, every pair) are the count's plus the
  elementwise work it leaves out (norms, softmax, RoPE: a few percent at these widths)."""
  cfg, xla = _xla_flops("ar", {}, _batch("ar", 2, 32, 0), grad=False, compiled=True)
  assert 1.0 <= xla / (2 * _dense(cfg, "ar", 32, {}, 0)) < 1.05


@pytest.mark.fast
@pytest.mark.parametrize("name,args", [
    ("ar", {}), ("tidar", {"block_size": 4}), ("jacobi_forcing", {"prompt_len": 8}), ("asarm", {}),
    ("deer_stage1", {}), ("deer_stage2", {"max_masked": 4, "blocks": 2})])
def test_training_step_matches_xla_cost_analysis(name, args):
  """forward + backward = 3x the forward, against XLA's count of the objective's own loss and
  gradient."""
  length, prompt = 32, 8
  cfg, xla = _xla_flops(name, args, _batch(name, 2, length, prompt), grad=True)
  assert 1.0 <= xla / (2 * 3 * _dense(cfg, name, length, args, prompt)) < 1.05


@pytest.mark.fast
def test_tidar_doubles_ar_and_the_comparison_formula_matches_ar():
  cfg = dataclasses.replace(CFG, max_seq_len=512)
  for tie in (False, True):
    c = dataclasses.replace(cfg, tie_embeddings=tie)
    ar = train_flops(c, "ar", 2, 512)
    np.testing.assert_allclose(ar / (2 * 512), comparison_flops_per_token(c, 512), rtol=0.01)
    # TiDAR's doubled row costs about twice AR's (block 8 adds 8 pairs per mask slot)
    np.testing.assert_allclose(train_flops(c, "tidar", 2, 512) / ar, 2.0, rtol=0.02)
  assert train_flops(cfg, "no such objective", 2, 64) is None  # unknown work: no figure


@pytest.mark.fast
def test_defaults_come_from_the_loss_signature():
  """Arguments not given take the registered loss's defaults (TiDAR's block 8, DEER's 16)."""
  assert pairs("tidar", 32) == pairs("tidar", 32, block_size=8)
  assert pairs("deer_stage2", 40) == pairs("deer_stage2", 40, max_masked=16, blocks=1)
