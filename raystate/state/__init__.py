"""Model state on the worker: request states, input batch, persistent lookback/replay buffers."""
