"""Attention implementations agree under every mask builder; the "auto" rule; the setting.

xla_chunked (tokamax) against the dense xla reference, forward and gradients (q, k, v and the
cache), float32 with highest precision. Shapes cross tokamax's chunk edges (512 query rows,
1024 keys) where a builder allows, so the online softmax merges masked and visible chunks.
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.decoding import deer_layout
from paraflax.hf.config import hf_config_from_model, model_config_from_hf
from paraflax.model import attention, masks
from paraflax.model.cache import ChunkKV, commit, init_cache
from paraflax.model.config import MOVED
from paraflax.model.transformer import Queries
from paraflax.training.config.train import TrainConfig, config_differences, load_config
from conftest import MICRO

H, HKV, D = 4, 2, 8
C, P, N = masks.CLEAN, masks.PROMPT, masks.NOISY


# cache slots S of each case (0: no cache); the masks are `_build`'s
SLOTS = {"causal": 0, "block_causal": 0, "over_cache": 1030, "decode": 1030,
         "decode_candidates": 40, "noise_aware": 0, "tidar": 0, "tidar_train": 0,
         "tidar_prefill": 0, "tidar_decode": 1030, "lattice_content": 0, "lattice_query": 0,
         "deer_draft": 1030, "all_false_rows": 0}


def _build():
  """{case: mask [B, T, S+T]}: each builder of masks.py at a shape that exercises it."""
  r = np.random.default_rng(0)
  blocks = jnp.asarray(np.sort(r.integers(0, 5, (2, 600)), axis=1))
  jf = jnp.array([[P] * 4 + [N] * 3 + [C] * 3 + [N] * 3 + [C] * 3] * 2)
  td_kinds = jnp.array([[C] * 6 + [masks.MASKED] * 6] * 2)
  td_blocks = jnp.array([[0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]] * 2)
  first = lambda n, lengths: jnp.arange(n)[None] < jnp.array(lengths)[:, None]
  visible = jnp.asarray(r.random((2, 40)) < 0.3).at[1].set(False)  # row 1: no prompt at all
  content, query = masks.lattice(visible, first(40, [40, 33]))
  _, _, deer = deer_layout.draft_inputs(
      jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5), jnp.int32), first(5, [5, 3]),
      jnp.array([9, 7]), 4, 2, 3, jnp.array([4, 1030]), 1030)
  return {
      "causal": masks.causal(jnp.array([600, 300]), 600),  # crosses the 512-row chunk edge
      "block_causal": masks.block_causal(blocks),
      "over_cache": masks.over_cache(jnp.array([3, 1030]), 1030,
                                     masks.block_causal(jnp.array([[0, 0, 1, 1, 1, 2]] * 2))),
      "decode": masks.decode(jnp.array([0, 1030]), 1030, 5),  # row 0: a masked key chunk first
      "decode_candidates": masks.decode_candidates(jnp.array([7, 40]), 40, 4, 3, 2),
      "noise_aware": masks.noise_aware(jf, first(16, [16, 13])),
      "tidar": masks.tidar(td_kinds, td_blocks, first(12, [12, 9])),
      "tidar_train": masks.tidar_train(300, jnp.array([4, 8])),
      "tidar_prefill": masks.tidar_prefill(jnp.array([20, 11]), 20, 4),
      "tidar_decode": masks.tidar_decode(jnp.array([2, 1030]), 1030, 3),
      "lattice_content": content,
      "lattice_query": query,  # row 1's first target sees nothing: a fully masked row
      "deer_draft": deer,
      "all_false_rows": masks.causal(jnp.array([9, 0]), 9).at[0, 3].set(False),
  }


# cache_slots is a [B, S] part, not a mask: over_cache, decode and the decode builders use it
NOT_MASKS = {"cache_slots"}


def test_every_builder_is_covered():
  builders = {name for name, f in inspect.getmembers(masks, inspect.isfunction)
              if f.__module__ == masks.__name__}
  covered = {name.removesuffix("_content").removesuffix("_query") for name in SLOTS}
  assert builders - NOT_MASKS <= covered, sorted(builders - NOT_MASKS - covered)


def _pad(mask, s, s_to, t_to):
  """`mask` [B, T, S+T] as [B, t_to, s_to+t_to]: cache and chunk parts padded with False."""
  t = mask.shape[1]
  grow = lambda x, cols: jnp.pad(x, ((0, 0), (0, t_to - t), (0, cols)))
  return jnp.concatenate([grow(mask[..., :s], s_to - s), grow(mask[..., s:], t_to - t)], -1)


def _stack(cached: bool):
  """The cases with (without) a cache padded to one shape and stacked along the batch, so one
  compilation serves all (padding rows are fully masked rows, padding keys invisible):
  (names, rows per case, mask)."""
  names = [k for k, s in SLOTS.items() if (s > 0) == cached]
  shapes = jax.eval_shape(_build)
  s_to = max(SLOTS[k] for k in names)
  t_to = max(shapes[k].shape[1] for k in names)
  mask = jax.jit(lambda: jnp.concatenate(
      [_pad(m, SLOTS[k], s_to, t_to) for k, m in _build().items() if k in names]))()
  return names, [shapes[k].shape[0] for k in names], mask


@jax.jit
def _both(mask, seed):
  """Outputs and gradients (q, k, v, cache k, cache v) of xla and xla_chunked, and w."""
  b, t, k = mask.shape
  s = k - t
  ks = jax.random.split(jax.random.key(seed), 6)
  q, w = (jax.random.normal(x, (b, t, H, D)) for x in ks[:2])
  kv = [jax.random.normal(x, (b, t, HKV, D)) for x in ks[2:4]]
  cache = [jax.random.normal(x, (b, s, HKV, D)) for x in ks[4:]]

  def run(impl):
    def f(q, k, v, ck, cv):
      out = attention.attend(q, k, v, mask, attention=impl, cache_kv=(ck, cv) if s else None)
      return jnp.sum(out * w), out
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        q, *kv, *cache)
    return out, grads
  return run("xla"), run("xla_chunked")


@pytest.mark.parametrize("cached", [False, True], ids=["no_cache", "over_cache"])
def test_chunked_equals_dense(cached):
  names, sizes, mask = _stack(cached)
  (out, grads), (out_c, grads_c) = _both(mask, 0)
  assert np.isfinite(np.asarray(out_c)).all()
  for g_c in grads_c:
    assert np.isfinite(np.asarray(g_c)).all()
  start = 0
  for name, size in zip(names, sizes):
    rows = slice(start, start + size)
    start += size
    np.testing.assert_allclose(out_c[rows], out[rows], atol=1e-5, rtol=1e-5, err_msg=name)
    for g, g_c, what in zip(grads, grads_c, ("q", "k", "v", "cache k", "cache v")):
      np.testing.assert_allclose(g_c[rows], g[rows], atol=1e-5, rtol=1e-5,
                                 err_msg=f"{name}: d/d {what}")


def _inputs(mask, seed=0):
  b, t, _ = mask.shape
  r = np.random.default_rng(seed)
  return (r.standard_normal((b, t, H, D), np.float32),
          *(r.standard_normal((b, t, HKV, D), np.float32) for _ in range(2)))


_dense = jax.jit(functools.partial(attention.attend, attention="xla"))


def test_fully_masked_row_is_the_mean_of_all_values():
  """Defined on xla (xla_chunked equals it, `all_false_rows` above): uniform weights."""
  mask = masks.causal(jnp.array([9, 0]), 9).at[0, 3].set(False)
  q, k, v = _inputs(mask)
  out = _dense(q, k, v, mask)
  mean = lambda row: np.repeat(v[row].mean(0), H // HKV, axis=0)  # [H, D]: head h reads h // G
  np.testing.assert_allclose(out[1], np.broadcast_to(mean(1), out[1].shape), atol=1e-6)
  np.testing.assert_allclose(out[0, 3], mean(0), atol=1e-6)


def test_grouped_query_heads_read_their_kv_head():
  """Query head h reads kv head h // G: plain multi-head attention on repeated k, v (xla;
  xla_chunked equals xla above)."""
  mask = masks.causal(jnp.array([7, 5]), 7)
  q, k, v = _inputs(mask)
  rep = lambda x: np.repeat(x, H // HKV, axis=2)
  np.testing.assert_allclose(_dense(q, k, v, mask), _dense(q, rep(k), rep(v), mask), atol=1e-6)


def test_auto_rule():
  f32, bf16 = jnp.float32, jnp.bfloat16
  r = attention.resolve
  assert r("auto", "cpu", f32, max_len=4096, rows=1, cached=True) == "xla"  # decode rule
  assert r("auto", "cpu", f32, max_len=4096, rows=64, cached=True) == "xla"
  assert r("auto", "cpu", f32, max_len=4096, rows=65, cached=True) == "xla_chunked"
  assert r("auto", "cpu", f32, max_len=4096, rows=16) == "xla_chunked"  # prefill: no cache
  assert r("auto", "cpu", bf16, max_len=4096, rows=4096) == "xla_chunked"
  assert r("auto", "cpu", f32, max_len=512, rows=512) == "xla"  # a small model stays dense
  assert r("auto", "gpu", f32, max_len=512, rows=512) == "xla"  # in float32 anywhere
  assert r("auto", "gpu", bf16, max_len=512, rows=512) == "cudnn"  # not at 16 bits
  assert r("auto", "gpu", f32, max_len=4096, rows=4096) == "xla_chunked"  # float32 exactness
  assert r("auto", "tpu", f32, max_len=4096, rows=4096) == "xla_chunked"
  # 16-bit compute on an accelerator: its fused kernel (docs/kernels.md)
  assert r("auto", "gpu", bf16, max_len=4096, rows=4096) == "cudnn"
  assert r("auto", "gpu", bf16, max_len=4096, rows=129, cached=True) == "cudnn"  # wide step
  assert r("auto", "tpu", bf16, max_len=4096, rows=4096) == ("mosaic", "xla_chunked")
  # a 16-bit decode step on a GPU: the decode kernel (one per layer); float32 and TPUs dense
  assert r("auto", "gpu", bf16, max_len=4096, rows=1, cached=True) == "gpu_decode"
  assert r("auto", "gpu", bf16, max_len=4096, rows=64, cached=True) == "gpu_decode"
  assert r("auto", "gpu", bf16, max_len=4096, rows=128, cached=True) == "gpu_decode"  # TiDAR k=8
  # ... and a TPU's up to 128 rows the TPU decode layer (splash would copy the cache in front
  # of the chunk), in float32 dense
  assert r("auto", "tpu", bf16, max_len=4096, rows=72, cached=True) == "tpu_decode"  # TiDAR k=8
  assert r("auto", "tpu", bf16, max_len=4096, rows=129, cached=True) == ("mosaic", "xla_chunked")
  assert r("auto", "gpu", f32, max_len=4096, rows=1, cached=True) == "xla"
  assert r("auto", "tpu", bf16, max_len=4096, rows=1, cached=True) == "tpu_decode"
  assert r("auto", "tpu", f32, max_len=4096, rows=1, cached=True) == "xla"
  # named: steps over a cache take it (interpreted on the CPU); other calls resolve as "auto"
  assert r("gpu_decode", "cpu", f32, max_len=4096, rows=1, cached=True) == "gpu_decode"
  assert r("gpu_decode", "gpu", bf16, max_len=4096, rows=512) == "cudnn"
  assert r("tpu_decode", "cpu", f32, max_len=4096, rows=128, cached=True) == "tpu_decode"
  assert r("tpu_decode", "cpu", f32, max_len=4096, rows=129, cached=True) == "xla_chunked"
  for name in ("xla", "xla_chunked"):  # explicit values are taken as given
    assert r(name, "cpu", f32, max_len=64, rows=1, cached=True) == name
  assert r("cudnn", "gpu", bf16) == "cudnn"
  with pytest.raises(ValueError, match="needs a GPU or TPU"):
    r("triton", "cpu", f32)


def test_bad_value_is_one_clear_line():
  with pytest.raises(ValueError, match=r"run.attention must be one of auto, xla, xla_chunked"
                     ) as e:
    pf.RunControl(attention="flash")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"ModelConfig takes no attention: it is run control now, "
                     r"RunControl\(attention=...\)") as e:
    pf.ModelConfig(**MICRO, attention="xla")  # the keyword of schema 2
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="attention must be one of auto, xla"):
    attention.resolve("flash", "cpu", jnp.float32)  # called directly, not through RunControl


def test_moved_names_read_from_a_model_config_say_where_they_went():
  cfg = pf.ModelConfig(**MICRO)
  for name in MOVED:  # not None: an AttributeError of one line naming RunControl
    with pytest.raises(AttributeError, match=rf"^ModelConfig\.{name} moved to "
                       rf"RunControl\.{name} \(TrainConfig\.run\)$"):
      getattr(cfg, name)
    assert not hasattr(pf.ModelConfig, name) and name not in inspect.signature(pf.ModelConfig
                                                                               ).parameters
  assert pf.ModelConfig(**MICRO, remat=None) == cfg  # None is taken as not given
  other = dataclasses.replace(cfg, n_layers=3)  # still frozen, hashable and replaceable
  assert hash(other) != hash(cfg) and dataclasses.replace(other, n_layers=cfg.n_layers) == cfg
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.remat = "full"
  with pytest.raises(AttributeError, match="'ModelConfig' object has no attribute 'nope'"):
    cfg.nope


def test_setting_is_run_control_and_not_in_hf_configs():
  cfg = load_config("micro_ar")
  other = dataclasses.replace(cfg, run=pf.RunControl(attention="xla_chunked"))
  assert config_differences(cfg, other) == []
  old = cfg.to_dict()
  del old["run"]["attention"]  # a config saved before the setting existed
  assert TrainConfig.from_dict(old) == cfg and config_differences(TrainConfig.from_dict(old),
                                                                  other) == []
  hf = hf_config_from_model(other.model)
  assert "attention" not in hf
  assert model_config_from_hf(hf, max_seq_len=other.model.max_seq_len) == cfg.model


def test_model_forward_chunked_equals_dense():
  """A micro two-stream model computes the same logits with either, in one call that has a
  cache (xla_chunked reads a concatenated copy), content tokens and query-stream rows."""
  kw = {**MICRO, "two_stream": True}
  r = np.random.default_rng(0)
  cfg = pf.ModelConfig(**kw)
  shape = (cfg.n_layers, 2, 12, cfg.n_kv_heads, cfg.dim_per_head)
  kv = ChunkKV(k=r.standard_normal(shape, np.float32), v=r.standard_normal(shape, np.float32))
  cache = commit(init_cache(cfg, 2, 16), kv, np.tile(np.arange(12), (2, 1)), np.array([12, 9]))
  tokens = r.integers(0, cfg.vocab_size, (2, 3))
  pos = np.array([[12, 13, 14], [9, 10, 11]])
  mask = masks.decode(cache.lengths, cache.slots, 3)
  queries = Queries(pos + 1, mask.at[:, :, 17:].set(False))
  logits = {}
  for impl in ("xla", "xla_chunked"):
    model = pf.Transformer(cfg, rngs=nnx.Rngs(0), run=pf.RunControl(attention=impl))
    logits[impl] = nnx.jit(lambda m, *a: m(*a[:4], queries=a[4])[0])(
        model, tokens, pos, mask, cache, queries)
  np.testing.assert_allclose(logits["xla_chunked"], logits["xla"], atol=1e-5, rtol=1e-5)
