"""The stores a FlashFFN asks for rows: dense, streamed (naive / hybrid), flash, dip.

Only runtime/build.py makes them; base.py holds what they share. May import:
errors, io (through the reader handed in), cache, layout, models.ffn / models.half,
sparsity (top_k_mask), runtime.stats, runtime.memory (trim_heap).
"""
