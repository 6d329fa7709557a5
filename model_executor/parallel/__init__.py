"""Tensor parallelism on the model side: which slice of each weight a rank holds (layout.py), the
collectives a sharded forward runs (state.py), the vocab-parallel embedding (layers.py) and the
loader that reads only a rank's slices from safetensors files (shard_loader.py). The processes
themselves are the engine's (engine/tp_executor.py, engine/tp_worker.py)."""
