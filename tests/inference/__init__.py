"""Tests of services.inference: tiny models, tokenizer, sampling, engine."""
