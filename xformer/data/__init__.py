"""Dataset builders, tokenizers and input pipelines."""
