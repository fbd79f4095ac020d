"""The decoder protocols: each entry point refuses the wrong kind of decoder with one clear
TypeError before any device work, and `pf.generate_fn` is a pure function that runs inside a
user's `jax.jit` and through `jax.export` with `pf.generate`'s tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.decoding.checks import prepare_prompts

D = pf.decoders


@pytest.mark.parametrize("decoder, match", [
    (D.ASSD(3), r"^ASSD is an infill decoder: call pf.infill\(model, tokens_with_holes"),
    (D.AnyOrder(), r"^AnyOrder is an infill decoder: call pf.infill\("),
    (pf.Greedy(), r"^Greedy is a sampler, not a decoder: .*decoder=pf.decoders.AR\(sampler="),
    (pf.TopK(5), r"^TopK is a sampler, not a decoder"),
    (D.AR, r"^decoder=pf.decoders.AR is the class: pass an instance, e.g. "
           r"decoder=pf.decoders.AR\(\)"),
    (D.ASSD, r"^decoder=pf.decoders.ASSD is the class"),
    ("jacobi", r"^decoder must be one of pf.decoders \(an instance\) for pf.generate, got str"),
])
@pytest.mark.fast
def test_generate_refuses_the_wrong_kind_of_decoder(model, decoder, match):
  for entry in (lambda: pf.generate(model, [[1, 2]], decoder=decoder, max_new_tokens=2),
                lambda: next(pf.generate_steps(model, [[1, 2]], decoder, 2)),
                lambda: pf.generate_fn(model, decoder, 2)):
    with jax.transfer_guard("disallow"), pytest.raises(TypeError, match=match) as err:
      entry()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("decoder, match", [
    (D.Jacobi(4), r"^Jacobi is a generate decoder: call pf.generate\(model, prompts"),
    (D.AR(), r"^AR is a generate decoder"),
    (D.DEER(4), r"^DEER is a generate decoder"),
    (pf.Greedy(), r"^Greedy is a sampler, not a decoder.*pf.infill"),
    (D.ASSD, r"^decoder=pf.decoders.ASSD is the class: pass an instance"),
    (D.AR, r"^decoder=pf.decoders.AR is the class"),
])
@pytest.mark.fast
def test_infill_refuses_the_wrong_kind_of_decoder(model, decoder, match):
  with jax.transfer_guard("disallow"), pytest.raises(TypeError, match=match) as err:
    pf.infill(model, [[1, pf.HOLE]], decoder=decoder)
  assert "\n" not in str(err.value)


@pytest.mark.fast
def test_every_decoder_is_one_kind_with_its_own_state_type():
  for name in D.__all__:
    cls = getattr(D, name)
    assert issubclass(cls, D.Decoder) != issubclass(cls, D.InfillDecoder), name
    if issubclass(cls, D.Decoder):
      assert issubclass(cls.State, pf.decoding.state.DecodeState), name


@pytest.mark.fast
def test_vectorised_prompt_checks_pad_lists_and_arrays_alike():
  rows = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3], [np.int32(11)]]
  padded, lengths = prepare_prompts(rows, 48)
  assert padded.shape == (3, 16) and lengths.tolist() == [3, 10, 1]
  assert padded[1, :10].tolist() == rows[1] and not padded[0, 3:].any()
  arr = np.full((3, 10), 47, np.int64)  # junk past each length is neither checked nor kept
  for i, r in enumerate(rows):
    arr[i, :len(r)] = r
  arr[2, 5] = 99
  again, lens = prepare_prompts(arr, 48, prompt_lengths=lengths)
  np.testing.assert_array_equal(again, padded)
  np.testing.assert_array_equal(lens, lengths)
  with pytest.raises(ValueError, match=r"\(row, id\) = \[\(2, 99\)\]"):
    prepare_prompts(arr, 48)


def test_generate_fn_runs_in_a_user_jit_and_through_jax_export(model):
  prompts = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40]]
  dec = D.Jacobi(2)
  want = pf.generate(model, prompts, decoder=dec, max_new_tokens=4, eos_id=7)
  padded, lengths = prepare_prompts(prompts, model.cfg.vocab_size)
  run = pf.generate_fn(model, dec, max_new_tokens=4, eos_id=7)
  params = nnx.state(model)

  @jax.jit
  def serve(params, prompts, lengths, seed):  # a user's own jitted function
    out = run(params, prompts, lengths, jax.random.key(seed))
    return out.tokens, out.lengths

  tokens, lens = serve(params, padded, lengths, 0)
  np.testing.assert_array_equal(tokens, want.tokens)
  np.testing.assert_array_equal(lens, want.lengths)

  leaves, treedef = jax.tree.flatten(params)  # plain arrays: serialisable without nnx types

  def exported_fn(leaves, prompts, lengths, key_data):
    return run(jax.tree.unflatten(treedef, leaves), prompts, lengths, key_data).tokens

  exp = jax.export.export(jax.jit(exported_fn))(
      leaves, jax.ShapeDtypeStruct(padded.shape, jnp.int32),
      jax.ShapeDtypeStruct(lengths.shape, jnp.int32),
      jax.ShapeDtypeStruct((2,), jnp.uint32))
  key_data = jax.random.key_data(jax.random.key(0))
  np.testing.assert_array_equal(exp.call(leaves, padded, lengths, key_data), want.tokens)
  back = jax.export.deserialize(exp.serialize())
  np.testing.assert_array_equal(back.call(leaves, padded, lengths, key_data), want.tokens)
