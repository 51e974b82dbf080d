"""LLaMA-architecture models: the Flax model, loaders, tokenizer and generation."""
