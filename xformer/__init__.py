"""xformer: Transformer and Transformer-XL experiments in JAX/Flax NNX."""
