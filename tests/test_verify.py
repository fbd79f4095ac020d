"""The shared acceptance core: greedy rules, exactness in closed form, and a whole speculative
loop sampled 30k times against the exact joint (with a biased negative control)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compiled_forward
from scipy import stats

import paraflax as pf
from paraflax import verify
from paraflax.model import masks


@pytest.mark.fast
def test_greedy_accepts_matching_prefix_then_target_token():
  logits = jax.nn.one_hot(jnp.array([[3, 1, 2, 0], [3, 1, 2, 0], [3, 1, 2, 0]]), 5) * 5.0
  drafts = jnp.array([[3, 1, 2], [3, 0, 2], [4, 1, 2]])
  n, nxt = verify.greedy(drafts, logits)
  np.testing.assert_array_equal(n, [3, 1, 0])
  np.testing.assert_array_equal(nxt, [0, 1, 3])  # bonus, correction, correction


def _random_dist(key, shape, sharp=2.0):
  return jax.nn.softmax(sharp * jax.random.normal(key, shape), -1)


@pytest.mark.fast
@pytest.mark.parametrize("sampler", [pf.Temperature(1.0), pf.Temperature(0.7), pf.TopK(3),
                                     pf.TopP(0.8, temperature=1.3)])
def test_emitted_token_is_distributed_as_target_in_closed_form(sampler):
  """P(emit x) = q(x) a(x) + (1 - sum_y q(y) a(y)) r(x) must equal p(x) for every x."""
  kp, kq = jax.random.split(jax.random.key(0))
  v = 7
  p = sampler.probs(3.0 * jax.random.normal(kp, (64, v)))
  q = sampler.probs(3.0 * jax.random.normal(kq, (64, v)))
  accept = verify.acceptance_probs(p, q)  # for every candidate draft x
  emitted = q * accept + (1.0 - jnp.sum(q * accept, -1, keepdims=True)) * verify.residual_probs(p, q)
  np.testing.assert_allclose(emitted, p, atol=1e-6)
  assert float(jnp.min(jnp.sum(q * accept, -1))) < 0.99  # rejections are possible


@pytest.mark.fast
def test_residual_without_mass_is_safe():
  p = jnp.array([[0.5, 0.5, 0.0]])
  r = verify.residual_probs(p, p)
  assert bool(jnp.all(jnp.isfinite(r)))
  np.testing.assert_allclose(r, p)


def test_point_mass_draft_accepts_with_target_probability():
  p = _random_dist(jax.random.key(1), (1, 2, 5))
  drafts = jnp.array([[2]])
  q = verify.point_mass(drafts, 5)
  rngs = jax.random.split(jax.random.key(2), 20000)
  n, _ = jax.vmap(lambda r: verify.stochastic(r, drafts, q, p))(rngs)
  assert abs(float(jnp.mean(n)) - float(p[0, 0, 2])) < 0.015


# --- whole-loop check on an enumerable table model -------------------------------------
V, L, K = 4, 3, 2  # vocab, tokens per sample, drafts per round


def _tables(key, sharp):
  """Conditional distributions for every prefix of length 0..L: [sum_d V^d, V]."""
  n = sum(V ** d for d in range(L + 1))
  return np.asarray(_random_dist(key, (n, V), sharp), np.float64)


def _index(seq, depth):
  """Row of the prefix seq[:, :depth] in a table: offset(depth) + base-V code."""
  offset = np.array([sum(V ** d for d in range(i)) for i in range(L + 2)])
  code = np.zeros(len(seq), np.int64)
  for i in range(L):
    code = np.where(i < depth, code * V + seq[:, i], code)
  return offset[np.minimum(depth, L)] + code


def _speculative_samples(p_tab, q_tab, rows, seed):
  """Draft K tokens from q, verify against p with `verify.stochastic`, until L tokens."""
  rng = np.random.default_rng(seed)
  key = jax.random.key(seed)
  seq = np.zeros((rows, L + 2 * K + 2), np.int64)  # room for finished rows to idle
  n = np.zeros(rows, np.int64)
  accepted = []
  while np.any(n < L):
    drafts = np.zeros((rows, K), np.int64)
    q = np.zeros((rows, K, V))
    p = np.zeros((rows, K + 1, V))
    work = seq.copy()
    for i in range(K + 1):
      depth = n + i
      p[:, i] = p_tab[_index(work, depth)]
      if i < K:
        q[:, i] = q_tab[_index(work, depth)]
        u = rng.random((rows, 1))
        drafts[:, i] = np.minimum((np.cumsum(q[:, i], -1) < u).sum(-1), V - 1)
        work[np.arange(rows), depth] = drafts[:, i]
    key, sub = jax.random.split(key)
    acc, nxt = verify.stochastic(sub, jnp.asarray(drafts, jnp.int32), jnp.asarray(q, jnp.float32),
                                 jnp.asarray(p, jnp.float32))
    acc, nxt = np.asarray(acc), np.asarray(nxt)
    accepted.append(acc[n < L])
    for r in np.flatnonzero(n < L):
      new = list(drafts[r, :acc[r]]) + [nxt[r]]
      seq[r, n[r]:n[r] + len(new)] = new
      n[r] += len(new)
  return seq[:, :L], np.bincount(np.concatenate(accepted), minlength=K + 1)


def _exact_joint(p_tab):
  joint = np.zeros((V,) * L)
  for flat in range(V ** L):
    x = np.array(np.unravel_index(flat, (V,) * L))[None]
    joint.flat[flat] = np.prod([p_tab[_index(x, np.array([d]))[0], x[0, d]] for d in range(L)])
  return joint


def chi_square_pvalue(samples_flat, probs_flat):
  """Pearson chi-square of observed counts vs expected, pooling cells expected < 5."""
  n = len(samples_flat)
  probs_flat = np.asarray(probs_flat, np.float64) / np.sum(probs_flat)  # float32 rounding
  observed = np.bincount(samples_flat, minlength=len(probs_flat)).astype(np.float64)
  expected = probs_flat * n
  small = expected < 5
  obs = np.append(observed[~small], observed[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp).pvalue


def enumerated_ar_joint(model, sampler, prompt, n_new: int):
  """Exact probability of every continuation of n_new tokens under the model's sampler-warped
  AR distribution: [V**n_new], in `np.ravel_multi_index` order."""
  v = model.cfg.vocab_size
  seqs = np.array(list(itertools.product(range(v), repeat=n_new)))
  full = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1)
  t = full.shape[1]
  logits, _ = compiled_forward(model)(jnp.asarray(full), jnp.broadcast_to(jnp.arange(t), full.shape),
                    masks.causal(jnp.full((len(seqs),), t), t))
  probs = np.asarray(sampler.probs(logits[:, len(prompt) - 1:t - 1]), np.float64)
  return np.prod(np.take_along_axis(probs, seqs[..., None], -1)[..., 0], -1)


def assert_samples_the_joint(sample, joint, monkeypatch, what: str) -> None:
  """`sample()` (flat outcome indices of a whole decoder) passes the chi-square test against
  the enumerated `joint`, and fails it once the residual is biased (negative control: the
  test can see an inexact verifier)."""
  pvalue = chi_square_pvalue(sample(), joint)
  assert pvalue > 1e-3, f"{what} deviates from the target joint (p={pvalue:.2e})"
  monkeypatch.setattr(verify, "residual_probs", lambda p, q: p)
  jax.clear_caches()  # the biased verifier must be traced anew
  biased = chi_square_pvalue(sample(), joint)
  assert biased < 1e-6, f"the test cannot see a biased verifier (p={biased:.2e})"


@pytest.mark.slow
def test_speculative_loop_samples_the_target_joint_and_biased_control_is_rejected(monkeypatch):
  kp, kq = jax.random.split(jax.random.key(3))
  p_tab, q_tab = _tables(kp, 1.5), _tables(kq, 1.5)
  joint = _exact_joint(p_tab).reshape(-1)
  rows = 30000
  codes = lambda s: np.ravel_multi_index(tuple(s.T), (V,) * L)

  samples, accepted = _speculative_samples(p_tab, q_tab, rows, seed=0)
  assert np.all(accepted > 1000), f"accept/reject paths not all exercised: {accepted}"
  pvalue = chi_square_pvalue(codes(samples), joint)
  assert pvalue > 1e-3, f"speculative samples deviate from the target joint (p={pvalue:.2e})"

  monkeypatch.setattr(verify, "residual_probs", lambda p, q: p)  # the classic bug
  biased = chi_square_pvalue(codes(_speculative_samples(p_tab, q_tab, rows, seed=0)[0]), joint)
  assert biased < 1e-6, f"the chi-square test cannot see a biased verifier (p={biased:.2e})"
