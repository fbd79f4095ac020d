"""`paraflax perf`: what paraflax does on the device JAX finds, as JSON rows and markdown tables.

Parts (one module each, run by `paraflax perf PART`): `slots` (the cost of a decode forward's
extra query slots), `decode` (every decoder against AR and the weight-read floor), `train`
(a training step per objective: time, tokens/s, MFU), `family` (the demo's models trained
from scratch at a larger shape, then benched). `rows` holds the row schema, `report` the
file a run writes, `tables` the markdown, `flops` FLOPs per token, MFU and device peaks,
`batches` the synthetic training batches per data source, `trace` the profile summary.
"""
