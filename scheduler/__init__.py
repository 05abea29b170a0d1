"""Torch-free bookkeeping: KV block allocation, sequences, the generation loop.

Nothing under scheduler/ imports torch (tests/test_layering.py checks it); tensors are the
engine's business. Front doors (server/) hand an engine executor to `EngineLoop`.
"""
