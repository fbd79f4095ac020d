"""All decoders, as frozen dataclasses: `pf.decoders.AR(sampler=...)`, ...

`pf.generate` runs the `Decoder`s: AR, Jacobi, JacobiMR, TiDAR, Speculative, DEER,
PromptLookup; `pf.infill` runs the `InfillDecoder`s: ASSD, AnyOrder (`decoding/protocol.py`).
"""

from paraflax.decoding.any_order import AnyOrder
from paraflax.decoding.assd import ASSD
from paraflax.decoding.autoregressive import AR
from paraflax.decoding.deer import DEER
from paraflax.decoding.jacobi import Jacobi
from paraflax.decoding.jacobi_mr import JacobiMR
from paraflax.decoding.prompt_lookup import PromptLookup
from paraflax.decoding.protocol import Decoder, InfillDecoder  # noqa: F401 (pf.decoders.Decoder)
from paraflax.decoding.speculative import Speculative
from paraflax.decoding.tidar import TiDAR

__all__ = ["AR", "ASSD", "AnyOrder", "DEER", "Jacobi", "JacobiMR", "PromptLookup",
           "Speculative", "TiDAR"]
