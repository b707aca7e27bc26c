"""Inference for looped models: a KV cache per (block, loop step) and token generation."""
