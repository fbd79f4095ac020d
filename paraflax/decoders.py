"""All decoders, as frozen dataclasses: `pf.decoders.AR(sampler=...)`, ..."""

from paraflax.decoding.autoregressive import AR
from paraflax.decoding.prompt_lookup import PromptLookup

__all__ = ["AR", "PromptLookup"]
