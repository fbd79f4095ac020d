"""All decoders, as frozen dataclasses: `pf.decoders.AR(sampler=...)`, ..."""

from paraflax.decoding.assd import ASSD, AnyOrder
from paraflax.decoding.autoregressive import AR
from paraflax.decoding.jacobi import Jacobi
from paraflax.decoding.prompt_lookup import PromptLookup
from paraflax.decoding.speculative import Speculative
from paraflax.decoding.tidar import TiDAR

__all__ = ["AR", "ASSD", "AnyOrder", "Jacobi", "PromptLookup", "Speculative", "TiDAR"]
