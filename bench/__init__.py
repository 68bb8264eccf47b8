"""Benchmarks and the builders they share with the tests (tiny tokenizer, model directories)."""
