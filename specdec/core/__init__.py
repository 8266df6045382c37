"""The math of speculative decoding: pure functions and small value types.

Nothing here imports grpc, redis or a model. The tensor modules (`rng`, `sampling`,
`proposal`, `verify`) need torch; `params`, `prefix`, `acceptance` and `perf_model` are plain
Python, so the coordinator (which holds no model) imports them without loading torch.
See docs/architecture.md for the layering and the vocabulary.
"""
