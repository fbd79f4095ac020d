"""Objectives: the `Objective` protocol and registry (`protocol`), weighted means (`means`), the
chunked output-head loss (`head_loss`), one module per method (`ar`, `tidar`, `deer`, `asarm`,
`jacobi_forcing`: its loss, its data source and its masks) and their mask-tile structure
(`mask_tiles`)."""
