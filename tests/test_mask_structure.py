"""Structured masks (`mask_structure.py`): every builder's structured form expands to exactly
the dense array of its `masks.py` twin, over random inputs and shapes; the tile layout agrees
with the dense array."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paraflax.decoding import deer_layout
from paraflax.model import mask_structure as ms
from paraflax.model import masks


SHAPES = [(1, 1, 0), (2, 7, 3), (3, 16, 5)]  # (B, T, S)


def _inputs(b: int, t: int, s: int, seed: int) -> dict:
  """Random builder inputs: lengths, cache lengths, kinds, block ids, sizes, flags."""
  rng = np.random.default_rng(seed)
  ints = lambda hi, shape: rng.integers(0, hi, shape).astype(np.int32)
  return {"lengths": ints(t + 1, (b,)), "cache": ints(s + 1, (b,)), "kinds": ints(4, (b, t)),
          "blocks": ints(3, (b, t)), "sizes": 1 + ints(4, (b,)), "valid": rng.random((b, t)) < 0.7,
          "visible": rng.random((b, t)) < 0.5}


def _random_cases(x: dict, t: int, s: int):
  """(name, structured, dense) for every builder at the inputs `x` (`_inputs`)."""
  lengths, cache, kinds, blocks, valid = (x[k] for k in ("lengths", "cache", "kinds", "blocks",
                                                         "valid"))
  yield "causal", ms.causal(lengths, t), masks.causal(lengths, t)
  b = lengths.shape[0]
  yield "causal full", ms.full_causal(b, t), masks.causal(jnp.full((b,), t), t)
  yield "block_causal", ms.block_causal(blocks), masks.block_causal(blocks)
  yield ("over_cache", ms.over_cache(cache, s, ms.block_causal(blocks)),
         masks.over_cache(cache, s, masks.block_causal(blocks)))
  yield "decode", ms.decode(cache, s, t), masks.decode(cache, s, t)
  for main, n, c in [(t, 1, 0), (t, 2, 3)]:
    yield ("decode_candidates", ms.decode_candidates(cache, s, main, n, c),
           masks.decode_candidates(cache, s, main, n, c))
  yield "noise_aware", ms.noise_aware(kinds, valid), masks.noise_aware(kinds, valid)
  yield "tidar", ms.tidar(kinds, blocks), masks.tidar(kinds, blocks)
  yield "tidar valid", ms.tidar(kinds, blocks, valid), masks.tidar(kinds, blocks, valid)
  yield "tidar_train", ms.tidar_train(t, x["sizes"]), masks.tidar_train(t, x["sizes"])
  yield ("tidar_prefill", ms.tidar_prefill(lengths, t, 3), masks.tidar_prefill(lengths, t, 3))
  k = 1 + t % 4
  yield "tidar_decode", ms.tidar_decode(cache, s, k), masks.tidar_decode(cache, s, k)
  for bidi in (False, True):
    yield (f"deer bidirectional={bidi}", ms.deer(kinds, blocks, valid, bidi),
           deer_layout.mask(kinds, blocks, valid, bidi))
  for v in (None, valid):
    for got, want in zip(ms.lattice(x["visible"], v), masks.lattice(x["visible"], v)):
      yield "lattice", got, want


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _compiled(x, t, s, bq, bk, only):
  return {f"{i} {name}": (st.dense() if bq is None else st.layout(bq, bk), dense)
          for i, (name, st, dense) in enumerate(_random_cases(x, t, s))
          if only is None or name in only}


def _expanded(b, t, s, seed, bq=None, bk=None, only=None):
  """{"i name": (structured.dense() or .layout(bq, bk), dense)} of the cases named in `only`
  (default all) at random inputs: one compiled program per shape."""
  return _compiled(_inputs(b, t, s, seed), t, s, bq, bk, only)


@pytest.mark.fast
@pytest.mark.parametrize("seed", [0, 1])
def test_every_structured_form_expands_to_its_dense_builder(seed):
  names = set()
  for shape in SHAPES:
    for name, (got, dense) in _expanded(*shape, seed).items():
      names.add(name.split()[1])
      np.testing.assert_array_equal(got, dense, err_msg=f"{name} at {shape}")
  # every `masks.py` builder of a [B, T, K] mask has its structured twin
  assert names >= {"causal", "block_causal", "over_cache", "decode", "decode_candidates",
                   "noise_aware", "tidar", "tidar_train", "tidar_prefill", "tidar_decode",
                   "lattice", "deer"}


def _dense_layout(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
  """The layout by definition, from the dense array: tile by tile over the real pairs."""
  b, t, k = dense.shape
  out = np.zeros((b, -(-t // bq), -(-k // bk)), np.int8)
  for i in range(out.shape[1]):
    for j in range(out.shape[2]):
      tile = dense[:, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      out[:, i, j] = np.where(~tile.any((1, 2)), ms.EMPTY,
                              np.where(tile.all((1, 2)), ms.FULL, ms.PARTIAL))
  return out


@pytest.mark.fast
def test_layout_agrees_with_the_dense_mask():
  """Tiles that do not divide T or K (3 x 5) over masks of every shape of rule: a cache
  prefix, interleaved streams, halves, the lattice."""
  only = ("over_cache", "noise_aware", "tidar_train", "lattice")
  for shape in SHAPES[1:]:
    for name, (got, dense) in _expanded(*shape, 2, 3, 5, only).items():
      np.testing.assert_array_equal(got, _dense_layout(np.asarray(dense), 3, 5),
                                    err_msg=f"{name} at {shape}")


@pytest.mark.fast
def test_tile_counts_of_a_causal_mask():
  """Causal, 4 x 4 tiles of 4 tokens: 6 empty above the diagonal, 6 full below, 4 partial."""
  counts = ms.tile_counts(ms.causal(jnp.array([16]), 16).layout(4, 4))
  assert counts == {"empty": 6 / 16, "full": 6 / 16, "partial": 4 / 16}


def test_training_tile_table_counts_the_pairs_the_flops_count_does():
  """`scripts/mask_tiles.py`'s table at 128 tokens, 32 x 32 tiles: the allowed pairs of AR,
  TiDAR and Jacobi Forcing are `flops.py`'s, and reordering a row's tokens keeps its pairs
  while emptying more tiles."""
  import paraflax as pf
  from paraflax.training.objectives.mask_tiles import JF_BLOCK, tile_table
  from paraflax.training.run.flops import objective_work

  t = 128
  rows = {r["objective"]: r for r in tile_table(t, tile=32, rows=2)}
  cfg = pf.ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=8,
                       max_seq_len=t)
  prompt = t - 2 * JF_BLOCK * (t * 3 // 4 // (2 * JF_BLOCK))
  for name, rows_x_keys, prompt_len in [("ar", t * t, 0), ("tidar", 4 * t * t, 0),
                                        ("jacobi_forcing", t * t, prompt)]:
    work = objective_work(cfg, name, t, prompt_len=prompt_len)
    assert rows[name]["pairs"] == pytest.approx(work.pairs / rows_x_keys), name
  plain, reordered = rows["asarm"], rows["asarm sorted"]
  assert reordered["pairs"] == pytest.approx(plain["pairs"])
  assert reordered["empty"] > plain["empty"]
  # Jacobi Forcing's streams one after the other: more skippable tiles than a causal mask
  assert rows["jacobi_forcing"]["empty"] > rows["ar"]["empty"]
  for r in rows.values():
    assert r["empty"] + r["full"] + r["partial"] == pytest.approx(1.0)
