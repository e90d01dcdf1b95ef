"""dspark: tools and a runtime for DSpark speculative decoding."""

from dspark_cli import triton_mode

__version__ = "0.1.0"

triton_mode.install()  # before anything (torch._dynamo included) can import triton; see triton_mode.py
