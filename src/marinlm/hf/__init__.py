"""Conversion between marinlm checkpoints and the Hugging Face ecosystem."""
