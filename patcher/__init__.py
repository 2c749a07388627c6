"""patch-dsv4: versioned, verifiable source edits to vLLM's DeepSeek-V4 code."""

__version__ = "0.1.0"
