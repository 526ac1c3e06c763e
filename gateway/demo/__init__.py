"""Offline demo models: tiny random-weight Llama folders with a freshly trained tokenizer (CLI tooling)."""
