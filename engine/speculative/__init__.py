"""Speculative decoding: draft trees, EAGLE draft heads, drafters and tree acceptance."""
