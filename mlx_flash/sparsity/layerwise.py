"""A model's FFN inputs and loss gradients recorded layer by layer, never the model at float32.

The threshold search (allocation.py) needs, for every layer i, the FFN's input X_i, the
gradient G_i = d NLL / d (FFN output) and the layer's FFN weights. Loading the model dense at
float32 for one forward and one backward pass would take 4 bytes a parameter (7 GB for a 1.5B
model); here one layer's float32 weights exist at a time:

1. forward: the token embeddings (only the calibration tokens' rows, dequantized), then each
   block in turn, its attention and norms dequantized from the resident file and its FFN rows
   read from the layer's flash file (read_layer_file), recording X_i and keeping the block's
   input h_i (tokens x d_model floats a layer);
2. the head: d NLL / d h_L through the final norm and the output head, a chunk of the vocabulary
   at a time (two passes: the log-sum-exp, then the softmax's product with the chunk's rows);
3. backward: each block again, from the last, its vector-Jacobian product taking d / d h_{i+1}
   to d / d h_i. A block adds its FFN's output to the residual stream, so G_i = d / d h_{i+1}.

The search then reads each layer's FFN rows again when it needs them (FFNWeights: the last few
layers' held), and keeps the activations it revisits on disk (Spill). Llama-family blocks
(attention, input and post-attention norms, a gated FFN): the models calibrated thresholds are
for.
"""

import json
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import FlashError
from ..models.ffn import FFNRows
from ..models.host import mlx_only

VOCAB_CHUNK = 8192  # output-head rows dequantized at a time (8192 x d_model floats, and their logits)
SEQS_AT_ONCE = 4  # calibration sequences through a block together (the FFN's temporaries: 4 x seq x d_ff)


class Resident:
    """The resident file's tensors, lazily (mx.load), dequantized on request as config.json's
    `quantization` says (mlx-lm's form: one entry per quantized module)."""

    def __init__(self, folder, manifest):
        self.folder = Path(folder)
        path = self.folder / manifest.resident["file"]
        try:
            self.tensors = mx.load(str(path))
        except Exception as e:
            raise FlashError(f"{path}: unreadable ({e})")
        config = json.loads((self.folder / "config.json").read_text())
        self.quantization = {k: v for k, v in (config.get("quantization") or {}).items() if isinstance(v, dict)}

    def __contains__(self, name):
        return name in self.tensors

    def weight(self, module, rows=None):
        """`module`.weight at float32 (rows: only those rows, an int array)."""
        w = self.tensors[f"{module}.weight"]
        q = self.quantization.get(module)
        if q is None:
            return (w if rows is None else w[rows]).astype(mx.float32)
        s, b = self.tensors[f"{module}.scales"], self.tensors[f"{module}.biases"]
        if rows is not None:
            w, s, b = w[rows], s[rows], b[rows]
        return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=q["group_size"],
                             bits=q["bits"]).astype(mx.float32)

    def n_rows(self, module):
        return self.tensors[f"{module}.weight"].shape[0]

    def block(self, family, args, layer):
        """Layer `layer`'s block at float32: its attention and norms from this file; its FFN's
        rows are not in it (the caller passes them)."""
        llama = family.__name__.endswith(".llama")
        if not llama or args.model_type == "granite" or args.mlp_bias:
            # (a Gemma block has these names, not this block's sums; Granite's multipliers and an
            # FFN's biases are not in its thresholds' sums)
            what = "an FFN with biases (mlp_bias)" if llama and args.mlp_bias else args.model_type
            raise FlashError(f"{self.folder}: layer-by-layer calibration is for Llama-family blocks; "
                             f"{what} is not one yet")
        block = family.TransformerBlock(args, layer)
        for name in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(block, name):
                raise FlashError(f"{self.folder}: layer-by-layer calibration is for Llama-family blocks "
                                 f"(attention, two norms and a gated FFN); {type(block).__name__} has no {name}")
        prefix = f"model.layers.{layer}."
        weights = []
        for name, _ in tree_flatten(block.parameters()):
            full = prefix + name
            module = full.rsplit(".", 1)[0]
            if name.endswith(".weight") and module in self.quantization:
                weights.append((name, self.weight(module)))
            elif full in self.tensors:
                weights.append((name, self.tensors[full].astype(mx.float32)))
            else:
                raise FlashError(f"{self.folder}: the resident file has no {full}")
        block.load_weights(weights, strict=False)
        mx.eval(block.parameters())
        return block


class FFNWeights:
    """Each layer's FFN rows at float32 (FFNRows: gate, up, down [n_ff, d_model]), read from its
    flash file (checked) when asked for and dequantized by the native kernels where they run
    (NumPy's dequantization takes ~0.5 s a layer of the 1.5B, the kernels' a tenth of it); the
    last `keep` layers asked for are held."""

    def __init__(self, folder, manifest, verify=True, keep=2):
        from ..layout.format import read_tables
        from ..runtime import cpu_kernels

        self.folder, self.manifest, self.verify, self.keep = Path(folder), manifest, verify, keep
        self.tables = read_tables(self.folder, manifest, manifest.layout, verify)
        self.kernels = cpu_kernels() if manifest.layout.quant is not None else None
        self.held = OrderedDict()

    def __len__(self):
        return len(self.manifest.ffn_files)

    def __getitem__(self, layer):
        if layer in self.held:
            self.held.move_to_end(layer)
            return self.held[layer]
        rows = self._rows(layer)
        if "gate" not in rows:
            raise FlashError(f"{self.folder}: calibrated thresholds are for gated (SwiGLU) FFNs")
        w = FFNRows(gate=mx.array(rows["gate"]), up=mx.array(rows["up"]), down=mx.array(rows["down"]))
        del rows
        mx.eval(w.gate, w.up, w.down)
        self.held[layer] = w
        while len(self.held) > self.keep:
            self.held.popitem(last=False)
        return w

    def _rows(self, layer):
        """{kind: float32 NumPy [n_ff, d_model]} of one layer's file."""
        from ..runtime import read_layer_bytes, read_layer_file

        lay, entry = self.manifest.layout, self.manifest.ffn_files[layer]
        tables = self.tables[layer] if self.tables else None
        if self.kernels is None:
            return read_layer_file(self.folder, entry, lay, self.verify, tables)
        from ..kernels import dequantize_cols, dequantize_rows

        raw = np.frombuffer(read_layer_bytes(self.folder, entry, self.verify), np.uint8).reshape(-1, lay.stride)
        q, ids = lay.quant, np.arange(raw.shape[0], dtype=np.int64)
        out = {}
        for k in lay.kinds:
            off = lay.kind_offset(k)
            part = np.ascontiguousarray(raw[:, off:off + lay.kind_bytes(k)])
            if k in lay.columns:
                out[k] = dequantize_cols(self.kernels, part, ids, ids // q.group_size, tables[k], q)
            else:
                out[k] = dequantize_rows(self.kernels, part, ids, q, *q.inline_offsets(lay.d_model), lay.d_model)
        return out


class Spill:
    """Float32 arrays by key, the last `hold` used kept in DRAM and the rest on disk (a temporary
    folder, removed by close()): the search's activations of every layer (tokens x d_ff floats
    each, 2 x layers of them) without holding them all."""

    def __init__(self, hold=4):
        self.dir = Path(tempfile.mkdtemp(prefix="mlx_flash_calibrate_"))
        self.hold, self.held = hold, OrderedDict()

    def _path(self, key):
        return self.dir / ("-".join(map(str, key)) + ".npy")

    def put(self, key, array):
        self._path(key).unlink(missing_ok=True)
        self.held[key] = array
        self.held.move_to_end(key)
        while len(self.held) > self.hold:  # (written when it leaves DRAM)
            old, a = self.held.popitem(last=False)
            np.save(self._path(old), np.array(a, dtype=np.float32))

    def get(self, key):
        if key in self.held:
            self.held.move_to_end(key)
            return self.held[key]
        array = mx.array(np.load(self._path(key)))
        self.put(key, array)
        return array

    def move(self, src, dst):
        """The array under `src` now under `dst` (no copy)."""
        if src in self.held:
            self.put(dst, self.held.pop(src))
        else:
            self._path(dst).unlink(missing_ok=True)
            self._path(src).replace(self._path(dst))
            self.held.pop(dst, None)

    def close(self):
        self.held.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def record(folder, manifest, seqs, progress=True, verify=True):
    """X [layers][tokens, d], G likewise (MLX float32) and FFNWeights of the llama-family model in
    `folder` on `seqs` (token id lists of one length, each position predicting the next): one
    forward and one backward pass, a layer's float32 weights at a time; all of it through MLX
    (the backward pass differentiates the blocks)."""
    with mlx_only():
        return _record(folder, manifest, seqs, progress, verify)


def _record(folder, manifest, seqs, progress, verify):
    from tqdm import tqdm

    from ..models import model_args

    family, args = model_args(json.loads((Path(folder) / "config.json").read_text()))
    res = Resident(folder, manifest)
    ffn = FFNWeights(folder, manifest, verify)
    n_layers = len(ffn)
    lengths = {len(s) for s in seqs}
    if len(lengths) != 1:
        raise FlashError("calibration sequences must have one length")
    ids = mx.array([s[:-1] for s in seqs])
    targets = np.array([s[1:] for s in seqs])
    h = res.weight("model.embed_tokens", ids.reshape(-1)).reshape(*ids.shape, -1)
    mx.eval(h)
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h[:SEQS_AT_ONCE], None)
    inputs, X = [], []
    bar = tqdm(total=3 * n_layers, desc="record", disable=not progress, leave=False)
    for layer in range(n_layers):  # forward: keep each block's input, record its FFN's
        block, w = res.block(family, args, layer), ffn[layer]
        inputs.append(h)
        outs, xs = [], []
        for part in range(0, h.shape[0], SEQS_AT_ONCE):
            y, x = _block(block, w, h[part:part + SEQS_AT_ONCE], mask)
            mx.eval(y, x)
            outs.append(y)
            xs.append(x.reshape(-1, x.shape[-1]))
        h = mx.concatenate(outs)
        X.append(mx.concatenate(xs))
        mx.eval(h, X[-1])
        bar.update(1)
    g = _head_gradient(res, args, h, targets)
    bar.update(n_layers)
    G = [None] * n_layers
    for layer in reversed(range(n_layers)):  # backward: G_i = d / d h_{i+1}
        G[layer] = g.reshape(-1, g.shape[-1])
        block, w = res.block(family, args, layer), ffn[layer]
        h_in = inputs[layer]
        grads = []
        for part in range(0, h_in.shape[0], SEQS_AT_ONCE):
            _, (gi,) = mx.vjp(lambda v: _block(block, w, v, mask)[0], [h_in[part:part + SEQS_AT_ONCE]],
                              [g[part:part + SEQS_AT_ONCE]])
            mx.eval(gi)
            grads.append(gi)
        g = mx.concatenate(grads)
        mx.eval(g, G[layer])
        inputs[layer] = None
        bar.update(1)
    bar.close()
    return X, G, ffn


def _block(block, w, h, mask):
    """A llama-family block on h [seqs, tokens, d] with FFN rows w -> (its output, its FFN's input)."""
    r = h + block.self_attn(block.input_layernorm(h), mask)
    x = block.post_attention_layernorm(r)
    y = (block.mlp._act(x @ w.gate.T) * (x @ w.up.T)) @ w.down
    return r + y, x


def _head_gradient(res, args, h, targets):
    """d (each sequence's mean NLL) / d h [seqs, tokens, d]: the final norm and the output head
    (lm_head, or the embeddings where tied), VOCAB_CHUNK rows at a time."""
    import mlx.nn as nn

    head = "lm_head" if "lm_head.weight" in res else "model.embed_tokens"
    norm = nn.RMSNorm(h.shape[-1], eps=args.rms_norm_eps)
    norm.load_weights([("weight", res.tensors["model.norm.weight"].astype(mx.float32))])
    flat_h = h.reshape(-1, h.shape[-1])
    z = norm(flat_h)
    mx.eval(z)
    vocab = res.n_rows(head)
    lse = mx.full((z.shape[0],), -mx.inf)
    for start in range(0, vocab, VOCAB_CHUNK):  # pass 1: log-sum-exp of every position's logits
        logits = z @ res.weight(head, mx.arange(start, min(vocab, start + VOCAB_CHUNK))).T
        lse = mx.logaddexp(lse, mx.logsumexp(logits, axis=-1))
        mx.eval(lse)
    dz = mx.zeros_like(z)
    for start in range(0, vocab, VOCAB_CHUNK):  # pass 2: softmax times the rows
        w = res.weight(head, mx.arange(start, min(vocab, start + VOCAB_CHUNK)))
        dz = dz + mx.exp(z @ w.T - lse[:, None]) @ w
        mx.eval(dz)
    t = mx.array(targets.reshape(-1))
    dz = (dz - res.weight(head, t)) / targets.shape[1]  # minus the target's row; a sequence's mean
    _, (dh,) = mx.vjp(norm, [flat_h], [dz])
    mx.eval(dh)
    return dh.reshape(h.shape)
