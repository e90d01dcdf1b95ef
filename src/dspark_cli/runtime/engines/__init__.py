"""engines/: one module per serving engine: what it refuses, how a checked pair is handed to it.

- vllm.py      vLLM: the speculative config and the `vllm serve` argv for a checked pair
"""
