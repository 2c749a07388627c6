"""Recorded fingerprints of known vLLM releases (one JSON file per release)."""
