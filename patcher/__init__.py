"""patch-dsv4: versioned, verifiable source edits to vLLM's DeepSeek-V4 code."""

# The one place the version is set: the package metadata reads it at build time (README: Releasing).
__version__ = "0.1.0"
