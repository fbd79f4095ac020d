"""`paraflax perf compile`: programs compiled for a GPU or TPU target on a host without one.

`targets` (what to compile for and its abstract devices), `programs` (the training step and
the generate loop on abstract inputs), `kernels` and `costs` (what the optimised HLO launches,
synchronises, reads and computes), `run` (the rows), `calibrate` (compile rows beside measured
ones, and the fit of time to kernels and bytes).
"""
