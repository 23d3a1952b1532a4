"""Fused tensors split at conversion: a source whose checkpoint stacks several weights in one
tensor (Phi-3's qkv_proj = [q; k; v] and gate_up_proj = [gate; up]) seen as the separate weights
a family's model holds, so that the FFN's gate and up rows become neurons of the flash layout
and q, k, v resident weights of their own.

The parts are row ranges of the fused tensor: whole rows, so a quantized tensor's packed values,
scales and biases split with them, exactly.
"""

from ..errors import FlashError


class FusedSource:
    """`source` with each fused tensor replaced by its parts. splits: {fused name: [(part name,
    first row, end row)]} (a family's fused_tensors(args))."""

    def __init__(self, source, splits):
        self._src = source
        self.config = source.config
        self._parts = {}  # part name -> (fused name, first, end)
        names = set(source.names())
        for fused, parts in splits.items():
            if fused not in names:
                continue  # (a checkpoint that stores the parts already)
            rows = source.shape(fused)[0]
            if parts[-1][2] != rows:
                raise FlashError(f"{fused} has {rows} rows, expected {parts[-1][2]} "
                                 f"({', '.join(p for p, _, _ in parts)}: is config.json right for these weights?)")
            for name, first, end in parts:
                self._parts[name] = (fused, first, end)
        self._fused = {fused for fused, _, _ in self._parts.values()}

    def names(self):
        out = []
        for name in self._src.names():
            if name in self._fused:
                out += [p for p, (f, _, _) in self._parts.items() if f == name]
            else:
                out.append(name)
        return out

    def shape(self, name):
        if name not in self._parts:
            return self._src.shape(name)
        fused, first, end = self._parts[name]
        return (end - first,) + tuple(self._src.shape(fused)[1:])

    def read(self, name):
        if name not in self._parts:
            return self._src.read(name)
        fused, first, end = self._parts[name]
        return self._src.read(fused)[first:end].copy()

    def read_quantized(self, name):
        if name not in self._parts:
            return self._src.read_quantized(name)
        fused, first, end = self._parts[name]
        return self._src.read_quantized(fused).rows(lambda a: a[first:end])

    def quant(self, name):
        return self._src.quant(self._parts.get(name, (name,))[0]) if hasattr(self._src, "quant") else None

    def lossy(self, name):
        return self._src.lossy(self._parts.get(name, (name,))[0]) if hasattr(self._src, "lossy") else None

    def write_tokenizer(self, out_dir):
        return self._src.write_tokenizer(out_dir)

    def close(self):
        return self._src.close()
