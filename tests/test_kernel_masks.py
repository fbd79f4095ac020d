"""What the attention kernels are given: a causal structure as the kernel's own causal mask
(`attention.kernel_mask`), TiDAR's clean half as a causal call of its own
(`attention.kernel_calls`), a subcausal one (Jacobi Forcing's streams) dense under the
kernel's causal mask, any other mask dense, and lengths padded to a kernel's block
(`attention._padded`). tokamax's XLA implementation takes the same arguments as its kernels
and runs here: values and gradients equal the dense reference (float32, highest)."""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paraflax.model import attention, masks
from paraflax.model import mask_structure as ms
from paraflax.training.objectives import jacobi_forcing as jf
from conftest import compiled_forward

pytestmark = pytest.mark.fast


def _qkv(b, t, s, seed=0, h=4, hkv=2, d=8):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (b, t, h, d)), jax.random.normal(k2, (b, s, hkv, d)),
          jax.random.normal(k3, (b, s, hkv, d)))


def _value_and_grads(fn, q, k, v, rows=None):
  """sum(fn * w) and its gradients, for a random cotangent w on the query `rows` (all)."""
  w = jax.random.normal(jax.random.key(9), q.shape)
  if rows is not None:
    w = w * rows[:, :, None, None]
  return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))(q, k, v)


def _tokamax(q, k, v, causal, arrays, block=1):
  """The kernel call of `attend` (padding included) with tokamax's XLA implementation."""
  t = q.shape[1]
  q, k, v, arrays = attention._padded(q, k, v, causal, arrays, block)
  if "mask" in arrays:
    arrays = {**arrays, "mask": arrays["mask"][:, None]}
  out = attention.tokamax_module().dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="xla", **arrays)
  return out[:, :t]


def _assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _deer_stage2():
  """Stage II rows of 10 clean tokens (right-padded to lengths 10, 7), two blocks each."""
  from paraflax.training.objectives import deer
  batch = {"tokens": jnp.arange(20).reshape(2, 10) % 7, "prompt_lens": jnp.array([3, 2]),
           "lengths": jnp.array([10, 7])}
  rows = deer.stage2_rows(batch, jnp.array([[4, 6], [3, 5]]), jnp.array([[2, 3], [1, 2]]), 3,
                          mask_id=5, sep_id=6, alpha=1.01)
  return dataclasses.replace(ms.deer(rows["kinds"], rows["blocks"], rows["valid"], False),
                             causal_rows=10)


def _jacobi_forcing_rows():
  """Two Jacobi Forcing rows of 12 slots, prompt region 4: prompts of 4 and 3 tokens (the
  second padded after its noisy stream), two blocks of 2 in each stream."""
  from paraflax.training.objectives import jacobi_forcing as jf
  rows = [jf.example(np.arange(p) + 4, np.full((2, 2), 5), np.full((2, 2), 6), 12) for p in (4, 3)]
  return ms.noise_aware(*(jnp.asarray(np.stack([r[k] for r in rows])) for k in ("kinds", "valid")),
                        prompt_len=4)


def _deer_stage1():
  """Stage I rows (prompts of 3 and 5 tokens, cut after 6 and 5) aligned at a longest prompt
  of 5: the prompt region causal, the answer region over every key."""
  from paraflax.training.objectives import deer
  batch = {"tokens": jnp.arange(22).reshape(2, 11) % 7 + 4, "prompt_lens": jnp.array([3, 5]),
           "lengths": jnp.array([10, 8])}
  prefix, j = jnp.array([6, 5]), jnp.arange(12)[None]
  masked = (j > prefix[:, None]) & (j <= batch["lengths"][:, None])
  rows = deer.stage1_rows(batch, prefix, jnp.array([0.5, 0.5]), masked, 5, 6)
  return deer.stage1_mask(deer.answers_aligned(rows, batch["prompt_lens"], 5), 5)


def _sorted_lattice():
  """Two streams of rows sorted prompt first (prompts of 4 and 2 tokens of 12)."""
  visible = jnp.arange(12)[None] < jnp.array([[4], [2]])
  return ms.two_stream(*ms.lattice(visible, sorted_rows=True))


MASKS = {
    "full causal": lambda: ms.full_causal(2, 12),
    "causal with padding": lambda: ms.causal(jnp.array([12, 7]), 12),
    "tidar_train": lambda: ms.tidar_train(6, jnp.array([2, 4])),
    "tidar_train in windows": lambda: dataclasses.replace(
        ms.tidar_train(10, jnp.array([2, 3])), windows=ms.tidar_windows(10, 3, rows=4)),
    "noise_aware": lambda: ms.noise_aware(
        jnp.array([[masks.PROMPT] * 4 + [masks.NOISY] * 4 + [masks.CLEAN] * 4] * 2),
        jnp.arange(12)[None] < jnp.array([[12], [10]])),
    "noise_aware in windows": _jacobi_forcing_rows,
    "deer_stage1 in windows": _deer_stage1,
    "tidar_prefill": lambda: ms.tidar_prefill(jnp.array([9, 5]), 9, 3),
    "deer_stage2": _deer_stage2,
    "two streams sorted": _sorted_lattice,
    "lattice": lambda: ms.lattice(jnp.asarray(np.random.default_rng(0).random((2, 12)) < 0.4))[0],
    "deer": lambda: ms.deer(jnp.array([[masks.CLEAN] * 7 + [masks.MASKED] * 5] * 2),
                            jnp.array([[0] * 7 + [1] * 5] * 2),
                            jnp.arange(12)[None] < jnp.array([[12], [9]]), bidirectional=True),
}


def _rows_read(mask, block):
  """The query rows `[B, T]` whose outputs must be the dense mask's (None: all). A row whose
  output is never read is free where the kernel attends it as causal: a padding row of a
  causal mask where the kernel takes no lengths, or of a padded prefix of `causal_rows`; a
  prompt token's query in a `subcausal` query stream."""
  padded = "valid" in mask.queries
  if "stream" in mask.queries:  # a subcausal query stream: its prompt rows are unread
    return (mask.queries["stream"] == 0) | ~mask.queries["visible"]
  if padded and ((mask.rule is ms.causal_rule and block > 1) or mask.causal_rows):
    return mask.queries["valid"]
  return None


@pytest.mark.parametrize("block", [1, 8], ids=["cudnn", "splash: padded to blocks of 8"])
@pytest.mark.parametrize("name", list(MASKS))
def test_kernel_arguments_equal_the_dense_mask(name, block):
  """Every objective's mask as a kernel gets it (causal: `is_causal`, with key lengths where
  the kernel takes them; subcausal: `is_causal` and dense; others dense), lengths padded as
  splash attention pads them. Where the kernel takes no lengths (splash), a causal mask with
  padding is its causal mask alone: every real row's output and its gradients are the dense
  mask's; the padding rows' outputs, which nothing reads, are not compared (nor those of a
  padded prefix attended as causal rows: TiDAR's prefill, nor a subcausal query stream's
  prompt rows). Windows (TiDAR's mask half, two streams) are a call each for cuDNN; splash
  takes the rows after the causal ones in one call."""
  mask = MASKS[name]()
  q, k, v = _qkv(*mask.shape)
  rows = _rows_read(mask, block)
  with jax.default_matmul_precision("highest"):
    want = _value_and_grads(lambda q, k, v: attention._dense(q, k, v, mask.dense(), None),
                            q, k, v, rows)
    calls = attention.kernel_calls(mask, q.shape[1], lengths=block == 1, windows=block == 1)
    causal = mask.rule in (ms.causal_rule, ms.full_causal_rule, *ms.SUBCAUSAL)
    windows = mask.windows if block == 1 else ()  # splash: the rest in one call
    if mask.causal_rows or windows:  # the causal rows', then every window's, dense
      windows = windows or [(0, 0, None, False)]
      assert [c[3] for c in calls] == [True] * bool(mask.causal_rows) + [w[3] for w in windows]
      assert [bool(c[4]) for c in calls] == [False] * bool(mask.causal_rows) + [True] * len(
          windows)
    else:
      assert [c[3] for c in calls] == [causal]
      arrays = not (mask.rule is ms.full_causal_rule or (mask.rule is ms.causal_rule
                                                          and block > 1))  # mask or lengths
      assert [bool(c[4]) for c in calls] == [arrays]

    def kernels(q, k, v):
      return jnp.concatenate([
          _tokamax(q[:, r0:r1], attention.keys_of(k, keys), attention.keys_of(v, keys), causal,
                   arrays, block) for r0, r1, keys, causal, arrays in calls], 1)
    got = _value_and_grads(kernels, q, k, v, rows)
  _assert_close(got, want)


@pytest.mark.parametrize("mask", [MASKS["noise_aware"](), ms.block_causal(
    jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]] * 2))], ids=["noise_aware", "block_causal"])
def test_a_subcausal_mask_sees_no_later_key_and_always_its_own(mask):
  """`SUBCAUSAL` is a claim about the rule: a kernel's causal mask on top changes no pair."""
  assert mask.rule in ms.SUBCAUSAL
  dense = np.asarray(mask.dense())
  t = dense.shape[1]
  assert not (dense & ~np.tril(np.ones((t, t), bool))).any()
  assert dense[:, np.arange(t), np.arange(t)].all()


def test_tidar_windows_hold_every_key_their_slots_see():
  """`windows` is a claim about the mask: no query of a window sees a key outside its
  segments, whatever the rows' block sizes up to `max_block`."""
  cases = [(10, [2, 3], 4), (64, [4, 8], 16), (64, [8, 8], 64), (30, [1, 5], 7)]
  for length, sizes, rows in cases:
    mask = ms.tidar_train(length, jnp.array(sizes), max_block=max(sizes))
    mask = dataclasses.replace(mask, windows=ms.tidar_windows(length, max(sizes), rows))
    dense = np.asarray(mask.dense())
    assert mask.windows[0][0] == length and mask.windows[-1][1] == 2 * length
    for r0, r1, segments, causal in mask.windows:
      assert not causal
      inside = np.zeros(2 * length, bool)
      for k0, k1 in segments:
        inside[k0:k1] = True
      assert not dense[:, r0:r1, ~inside].any(), (length, sizes, r0)
      assert inside.sum() < 2 * length or r1 - r0 == length  # a window drops keys


def test_a_sorted_query_stream_reads_no_later_key():
  """`subcausal` is a claim about the mask: every target's query (the rows read) sees no key
  after its own index and at least one key, and a two-stream mask is both streams' rows."""
  visible = jnp.asarray(np.random.default_rng(1).random((3, 16)) < 0.3).at[:, 0].set(True)
  visible = jnp.sort(visible, axis=1)[:, ::-1]  # each row's prompt first
  content, query = ms.lattice(visible, sorted_rows=True)
  assert query.subcausal and not content.subcausal
  dense = np.asarray(query.dense())
  targets = ~np.asarray(visible)
  assert not (np.triu(np.ones((16, 16), bool), 1)[None] & dense & targets[:, :, None]).any()
  assert dense[targets].any(-1).all()
  both = np.asarray(ms.two_stream(content, query).dense())
  assert (both == np.concatenate([np.asarray(content.dense()), dense], 1)).all()


@pytest.mark.parametrize("name", ["tidar_train", "deer_stage2", "tidar_prefill"])
def test_causal_rows_see_exactly_their_causal_keys(name):
  """`causal_rows` is a claim about the mask: its real rows are causal over as many keys, and
  see no key after them (so the kernel may attend them apart, over those keys alone)."""
  mask = MASKS[name]()
  dense, r = np.asarray(mask.dense()), mask.causal_rows
  real = np.asarray(mask.queries.get("valid", np.ones(dense.shape[:2], bool)))[:, :r]
  assert 0 < r < dense.shape[1]
  causal = np.tril(np.ones((r, r), bool))
  assert ((dense[:, :r, :r] == causal) | ~real[:, :, None]).all()
  assert not (dense[:, :r, r:] & real[:, :, None]).any()
  assert (np.asarray(mask.window(r, dense.shape[1], None).dense()) == dense[:, r:]).all()


def _jacobi_rows(prompts, region: int, n: int, blocks: int):
  """Jacobi Forcing rows of `region + 2 x blocks x n` slots, one per prompt length."""
  g = np.random.default_rng(0)
  rows = [jf.example(g.integers(4, 40, p), g.integers(4, 40, (blocks, n)),
                     g.integers(4, 40, (blocks, n)), region + 2 * blocks * n) for p in prompts]
  return ms.noise_aware(jnp.asarray(np.stack([r["kinds"] for r in rows])),
                        jnp.asarray(np.stack([r["valid"] for r in rows])), region)


def _asarm_rows(prompts, n: int):
  """Two streams of AS-ARM rows of `n` tokens sorted prompt first, one per prompt length."""
  visible = jnp.arange(n)[None] < jnp.array(prompts)[:, None]
  return ms.two_stream(*ms.lattice(visible, sorted_rows=True))


@pytest.mark.parametrize("name", ["jacobi_forcing", "tidar", "asarm"])
def test_splash_tiles_counted_empty_are_empty_in_every_row(name):
  """`splash_tiles` is a claim about the mask splash attention gets (after `_padded`): a tile
  it counts empty holds no pair in any row, whatever the prompts (Jacobi Forcing, the AS-ARM's
  two streams, whose query rows splash takes under the causal mask) or block sizes (TiDAR),
  and it does count some empty."""
  mask = {"jacobi_forcing": lambda: _jacobi_rows([1, 70, 128], 128, 16, 14),
          "tidar": lambda: ms.tidar_train(1024, jnp.array([3, 8, 5]), max_block=8),
          "asarm": lambda: _asarm_rows([1, 300, 511], 512)}[name]()
  b, t, s = mask.shape
  q, k, v = _qkv(b, t, s)
  calls = [c for c in attention.kernel_calls(mask, t, lengths=False, windows=False) if c[4]]
  assert calls
  for r0, r1, keys, causal, arrays in calls:
    keys_k = attention.keys_of(k, keys)
    full = jnp.broadcast_to(arrays["mask"], (b, r1 - r0, keys_k.shape[1]))
    padded = attention._padded(q[:, r0:r1], keys_k, keys_k, causal, {"mask": full},
                               attention.KERNEL_BLOCK)[3]["mask"]
    tq, tk = (n // attention.KERNEL_BLOCK for n in padded.shape[1:])
    seen = np.asarray(padded).reshape(b, tq, attention.KERNEL_BLOCK, tk,
                                      attention.KERNEL_BLOCK).any((0, 2, 4))
    run = attention.tile_map(mask.windows, r0, r1, keys, s, mask.rule in ms.SUBCAUSAL)
    assert run.shape == seen.shape and not (seen & ~run).any()
    assert attention.splash_tiles(mask, r0, r1, keys, s) == (run.sum(), run.size) and not run.all()
  query = ms.lattice(jnp.asarray(np.random.default_rng(1).random((2, 256)) < 0.5))[1]
  assert attention.splash_tiles(query, 0, 256, None, 256) is None  # rows may see no key


def test_splash_backward_key_blocks_divide_the_keys_up_to_512():
  """Splash's backward over a static mask: key blocks of at most `SPLASH_BWD_KEYS`, whole
  multiples of 128 that divide the (padded) keys."""
  got = {s: attention.splash_keys(s) for s in (128, 384, 640, 4096, 4224, 8192)}
  assert got == {128: 128, 384: 384, 640: 128, 4096: 512, 4224: 384, 8192: 512}


def test_padding_keys_are_unseen_and_rows_without_keys_average_the_real_values():
  """Padding keys hold large values (a weight on them would show; NaN would poison even a
  zero weight): no real query reads them, and a row with no key at all gets the mean of the
  real values (uniform weights) as on the dense path."""
  mask = masks.causal(jnp.array([5, 0]), 5) & (jnp.arange(5)[None, :, None] > 0)
  q, k, v = _qkv(2, 5, 5)
  want = attention._dense(q, k, v, mask, None)
  q8, k8, v8, arrays = attention._padded(q, k, v, False, {"mask": mask}, 8)
  k8, v8 = k8.at[:, 5:].set(100.0), v8.at[:, 5:].set(100.0)
  out = attention.tokamax_module().dot_product_attention(
      q8, k8, v8, mask=arrays["mask"][:, None], implementation="xla")[:, :5]
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_a_causal_mask_that_cannot_be_padded_is_refused():
  q, k, v = _qkv(1, 3, 5)
  with pytest.raises(ValueError, match="cannot be padded"):
    attention._padded(q, k, v, True, {}, 4)


def test_the_model_takes_a_structured_mask_in_place_of_the_dense_one(model):
  """The AR forward and TiDAR's doubled row, structured vs dense masks (here: expanded)."""
  forward = compiled_forward(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, model.cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  for dense, structured in [(masks.causal(jnp.array([20, 20]), 20), ms.full_causal(2, 20)),
                            (masks.causal(jnp.array([20, 13]), 20),
                             ms.causal(jnp.array([20, 13]), 20)),
                            (masks.tidar_train(10, jnp.array([2, 5])),
                             ms.tidar_train(10, jnp.array([2, 5])))]:
    want, want_kv = forward(tokens, pos, dense)
    got, got_kv = forward(tokens, pos, structured)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_kv.v, want_kv.v, rtol=1e-5, atol=1e-5)
