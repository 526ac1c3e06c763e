"""Reasoning output: thinking split from the answer, and budgets on thinking."""
