"""Jacobi Forcing data: schedule (Eq. 7), noisy-point choice, packing, noise-aware mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from paraflax import masks
from paraflax.training import jacobi_forcing as jf

pytestmark = pytest.mark.fast


def test_progressive_schedule_is_cyclic_and_linear():
  np.testing.assert_allclose(jf.noise_schedule(6, 4), [0, .25, .5, .75, 0, .25])
  with pytest.raises(ValueError, match="window must be >= 1"):
    jf.noise_schedule(3, 0)


def test_pick_noisy_takes_the_state_nearest_the_target_fraction():
  fixed = np.array([1, 2, 3, 4])
  traj = np.array([[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 3], [1, 2, 3, 4]])  # 1, .75, .5, 0
  assert jf.pick_noisy(traj, fixed, 0.5).tolist() == [1, 2, 9, 3]
  assert jf.pick_noisy(traj, fixed, 0.7).tolist() == [1, 9, 9, 9]
  assert jf.pick_noisy(traj, fixed, 0.9).tolist() == [9, 9, 9, 9]
  assert jf.pick_noisy(traj, fixed, 0.0).tolist() == [1, 2, 3, 4]


def test_packing_interleaves_blocks_and_pairs_share_positions():
  p = jf.pack(np.array([7, 8]), np.array([[1, 9], [3, 9]]), np.array([[1, 2], [3, 4]]))
  assert p.tokens.tolist() == [7, 8, 1, 9, 1, 2, 3, 9, 3, 4]
  assert p.positions.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
  assert p.kinds.tolist() == [0, 0, 1, 1, 2, 2, 1, 1, 2, 2]
  assert p.blocks.tolist() == [-1, -1, 0, 0, 0, 0, 1, 1, 1, 1]


def test_noise_aware_mask_equals_the_hand_built_one():
  p = jf.pack(np.array([7, 8]), np.zeros((2, 2), int), np.zeros((2, 2), int))
  got = np.asarray(masks.noise_aware(jnp.asarray(p.kinds)[None], jnp.ones((1, 10), bool))[0])
  want = np.array([[c == "1" for c in row] for row in [
      "1000000000",  # p
      "1100000000",  # p
      "1110000000",  # n1: prompt, itself causally
      "1111000000",
      "1100100000",  # c1: prompt, itself (not n1)
      "1100110000",
      "1111001000",  # n2: prompt, n1, itself
      "1111001100",
      "1100110010",  # c2: prompt, c1, itself
      "1100110011"]])
  np.testing.assert_array_equal(got, want)
  padded = masks.noise_aware(jnp.array([[0, 1, 2, 0]]), jnp.array([[True, True, True, False]]))
  np.testing.assert_array_equal(padded[0, :, 3], [False, False, False, True])
