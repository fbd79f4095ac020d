"""All decoders, as frozen dataclasses: `pf.decoders.AR(sampler=...)`, ..."""

from paraflax.decoding.autoregressive import AR

__all__ = ["AR"]
