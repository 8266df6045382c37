"""Text: tokenizers loaded from model directories, and streaming detokenisation with stops.

No torch: the coordinator (which holds no model) uses this layer for prompts and output text.
"""
