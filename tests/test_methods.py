"""The method table (`paraflax.methods`): every entry builds a decoder of its kind, the names it
gives `generate --decoder` and the bench's JSON rows stay the same, and bad names are one
line."""

import pytest

import paraflax as pf
from paraflax import methods
from paraflax.decoding.protocol import Decoder, InfillDecoder
from paraflax.evaluation.methods import bench_methods, infill_methods


@pytest.mark.fast
def test_every_entry_builds_a_decoder_of_its_kind():
  kinds = {"generate": Decoder, "infill": InfillDecoder}
  built = set()
  for m in methods.METHODS.values():
    dec = m.make()
    assert isinstance(dec, kinds[m.kind]) and dec.sampler.greedy
    built.add(type(dec).__name__)
    if m.n is not None:  # tokens per step: the bench's, or the one asked for
      assert m.make(3) != dec
      assert m.describe() == m.settings.format(n=m.n)
  assert built == set(pf.decoders.__all__)  # every decoder has an entry
  sampled = methods.METHODS["jacobi"].make(sampler=pf.TopK(4, temperature=0.5))
  assert sampled.sampler == pf.TopK(4, temperature=0.5)


@pytest.mark.fast
def test_cli_names_and_the_bench_row_names():
  assert methods.names() == ["ar", "jacobi", "jacobi-released", "jacobi-mr",
                             "jacobi-mr-released", "prompt-lookup", "tidar", "deer",
                             "speculative"]
  assert methods.names("infill") == ["any-order", "assd", "assd-ngram"]
  assert [m.name for m in bench_methods()] == ["jacobi", "jacobi_released", "jacobi_mr",
                                               "jacobi_released_mr", "prompt_lookup"]
  every = bench_methods({"jf": "JF", "tidar": "TD"}, {"deer": ("D", 50), "ar_drafter": ("A", 60)})
  assert [m.name for m in every] == [
      "jacobi", "jacobi_forcing", "jacobi_released", "jacobi_forcing_released", "jacobi_mr",
      "jacobi_forcing_mr", "jacobi_released_mr", "jacobi_forcing_released_mr", "prompt_lookup",
      "tidar_k4", "tidar_k8", "tidar_k16", "deer_k4", "deer_k8", "deer_k16",
      "spec_ar_k4", "spec_ar_k8", "spec_ar_k16"]
  by_name = {m.name: m for m in every}
  assert by_name["jacobi_forcing"].model == "JF" and by_name["jacobi_forcing"].weights == "jf"
  assert by_name["tidar_k8"].decoder == pf.decoders.TiDAR(block_size=8, beta=1.0)
  assert by_name["deer_k4"].draft_model == "D" and by_name["spec_ar_k16"].draft_model == "A"
  assert by_name["deer_k4"].decoder.vocab == 50 and by_name["spec_ar_k16"].decoder.vocab == 60
  assert by_name["jacobi_mr"].settings == "n16 K1 pool16 C3"
  assert [m.name for m in bench_methods(drafters={"deer": ("D", 50)}, ks=(8,))][-1] == "deer_k8"
  assert [(n, s) for n, s, _ in infill_methods(greedy=False)] == [
      ("any_order", "T=1"), ("assd_self", "k=5 T=1"), ("assd_ngram", "k=5 T=1")]


@pytest.mark.fast
def test_bad_names_and_settings_are_one_line_errors():
  with pytest.raises(ValueError, match="unknown decoder 'medusa': pick one of ar, jacobi,"):
    methods.decoder("medusa")
  with pytest.raises(ValueError, match="assd is a decoder for pf.infill, not pf.generate"):
    methods.decoder("assd")
  with pytest.raises(ValueError, match="--block-size does not apply to the ar decoder"):
    methods.decoder("ar", block_size=4)
  with pytest.raises(ValueError, match="--ngram does not apply to the jacobi decoder"):
    methods.decoder("jacobi", ngram=2)
  assert methods.decoder("prompt-lookup", block_size=4, ngram=2) == pf.decoders.PromptLookup(
      max_ngram=2, num_tokens=4)
  assert methods.needs_drafter("deer") and not methods.needs_drafter("tidar")
