"""Caches of rows: NeuronCache (paper §3.3: preallocated rows, swap-delete, append),
ExpertCache (EdgeMoE's expert buffer: slots shared by every layer's experts) and the
eviction policies (LRU, LFU, EdgeMoE, Belady). Knows rows and ids, never models or files;
may import io.native (its native row mover) only.
"""

from .neuron_cache import NeuronCache
