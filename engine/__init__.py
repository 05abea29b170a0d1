"""eagle-serve engine: model, paged KV cache, attention backends, sampling.

Importing this package does not import torch: `engine.sampling_params`, `engine.model_config` and
`engine.tokenizer` are torch-free so the scheduler can use them. Tensor code lives in the other
modules and is imported explicitly.
"""
