"""dspark: tools and a runtime for DSpark speculative decoding."""

__version__ = "0.1.0"
