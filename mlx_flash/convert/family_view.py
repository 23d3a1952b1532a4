"""A source seen as its family's model holds it: fused tensors split, tensors renamed, the config
the converted folder keeps.

Fused tensors are split at conversion: a source whose checkpoint stacks several weights in one
tensor (Phi-3's qkv_proj = [q; k; v] and gate_up_proj = [gate; up], Falcon's and Persimmon's
query_key_value with each head's q, k and v rows side by side) seen as the separate weights a
family's model holds, so that the FFN's gate and up rows become neurons of the flash layout and
q, k, v resident weights of their own.

Each part is a set of rows of the fused tensor (an index array, in the part's order; a bias
splits with its weight's rows): whole rows, so a quantized tensor's packed values, scales and
biases split with them, exactly. A family whose checkpoints name tensors otherwise than its
functions do (Falcon's transformer.h.N, Gemma 3's multimodal language_model.model.N) renames
them here too (its source_name); one whose config.json describes more than the text model the
folder will hold (Gemma 3's multimodal config, its text model in text_config) gives that model's
config (its source_config).
"""

import numpy as np

from ..errors import FlashError


class FamilyView:
    """`source` with each fused tensor replaced by its parts. splits: {fused name: [(part name,
    its rows: an index array)]} (a family's fused_tensors(args)), in the family's names; every row in
    exactly one part. rename: a source name -> the family's (None: the same). config: the
    config.json the folder keeps (None: the source's)."""

    def __init__(self, source, splits, rename=None, config=None):
        self._src = source
        self.config = source.config if config is None else config
        self._source_names = {(rename(n) if rename else n): n for n in source.names()}  # ours -> source's
        self._parts = {}  # part name -> (fused name, its rows)
        for fused, parts in splits.items():
            if fused not in self._source_names:
                continue  # (a checkpoint that stores the parts already)
            rows = self.shape(fused)[0]
            want = sum(len(idx) for _, idx in parts)
            if want != rows:
                raise FlashError(f"{fused} has {rows} rows, expected {want} "
                                 f"({', '.join(p for p, _ in parts)}: is config.json right for these weights?)")
            for name, idx in parts:
                self._parts[name] = (fused, np.asarray(idx))
        self._fused = {fused for fused, _ in self._parts.values()}

    def names(self):
        out = []
        for name in self._source_names:
            if name in self._fused:
                out += [p for p, (f, _) in self._parts.items() if f == name]
            else:
                out.append(name)
        return out

    def _source(self, name):
        """The source's name of one of ours, or of the fused tensor a part comes from."""
        return self._source_names[self._parts[name][0] if name in self._parts else name]

    def shape(self, name):
        shape = self._src.shape(self._source(name))
        return (len(self._parts[name][1]),) + tuple(shape[1:]) if name in self._parts else shape

    def read(self, name):
        w = self._src.read(self._source(name))
        return w[self._parts[name][1]] if name in self._parts else w

    def read_quantized(self, name):
        w = self._src.read_quantized(self._source(name))
        return w.rows(lambda a: a[self._parts[name][1]]) if name in self._parts else w

    def quant(self, name):
        return self._src.quant(self._source(name)) if hasattr(self._src, "quant") else None

    def lossy(self, name):
        return self._src.lossy(self._source(name)) if hasattr(self._src, "lossy") else None

    def write_tokenizer(self, out_dir):
        return self._src.write_tokenizer(out_dir)

    def close(self):
        return self._src.close()
