"""The run: the resumable trainer (`trainer`), the jitted step and evaluation (`step`),
gradient accumulation (`accumulate`), the optimizer (`optim`), the metrics log (`metrics`),
profiling (`profile`), Ctrl-C handling (`interrupt`), the compiled-only step (`dry_run`) and
FLOPs per token (`flops`)."""
