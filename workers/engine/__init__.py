"""The serving engine: paged KV cache, prefix caching, continuous batching, Llama-family models."""
