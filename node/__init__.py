"""bitexact node: deterministic GGUF inference engine, sampler, tokenizer and CLI."""

__version__ = "0.1.0"
