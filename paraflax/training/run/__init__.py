"""The run: the resumable trainer (`trainer`), the jitted step and evaluation (`step`), the
training state stacked by layer (`layout`), gradient accumulation (`accumulate`), the
optimizer (`optim`), the metrics log (`metrics`), profiling (`profile`), Ctrl-C handling
(`interrupt`), the compiled-only step (`dry_run`), the memory choices fitted by XLA's memory
analysis (`fit`) and FLOPs per token (`flops`)."""
