"""The GPU device check: prepared here on CPU, run once on a lent GPU machine.

`bench.gpu.probe` learns the device (versions, imports, what compiles and captures); `bench.gpu_check`
measures the engine there. Both write their JSON part by part, so a crash or a timeout keeps what
finished. `bench.gpu.harness` holds the section runner, `bench.gpu.models` builds the random-weight
models from carried tokenizer files (no download on the device).
"""
