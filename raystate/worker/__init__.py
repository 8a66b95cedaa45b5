"""raystate.worker: the model-state shard (request states, input batch, persistent lookback and replay
buffers, block tables, KV caches, sampler, CUDA graphs, the worker step) and its Ray actor."""
