"""Prompt sources with verifiable answers. Rows are dicts with at least 'prompt' and 'answer'."""
