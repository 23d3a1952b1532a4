"""A dense SwiGLU model rewritten as a mixture of experts that computes the same function: real
weights for measuring what expert-level choices cost in quality (per-expert bit widths,
EdgeMoE §3.2), where no real mixture of experts can be run on this machine.

Each layer's FFN is cut into E experts of d_ff / E consecutive neurons (gate and up rows, down
columns) in a Mixtral block that routes every token to all E experts (top-E of E) with a zero
router: the softmax over equal scores gives each expert weight 1 / E, and each expert's down
projection is scaled by E (a power of two: exact), so the block's output is the dense FFN's up to
the order of a float sum. What it cannot stand in for is routing: every expert serves every token.
"""

import json
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..layout.safetensors_io import SafetensorsWriter


def write_dense_as_moe(source, out, n_experts=8, n_layers=None):
    """A llama-family source (folder or GGUF) -> a Hugging Face Mixtral folder at `out` (float32);
    n_layers: only the first layers (a smaller, worse model of real weights, for tests)."""
    from ..convert.sources import open_source

    if n_experts & (n_experts - 1):
        raise FlashError(f"{n_experts} experts: a power of two keeps the rewrite exact")
    src = open_source(source)
    try:
        cfg = dict(src.config)
        if cfg.get("model_type") != "llama" or cfg.get("hidden_act", "silu") != "silu":
            raise FlashError(f"{source}: a llama-family SwiGLU model is rewritten, not {cfg.get('model_type')}")
        d_ff = cfg["intermediate_size"]
        if d_ff % n_experts:
            raise FlashError(f"{source}: FFN size {d_ff} is not a multiple of {n_experts} experts")
        d_e = d_ff // n_experts
        n_layers = n_layers or cfg["num_hidden_layers"]
        moe = dict(cfg, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=n_experts,
                   num_experts_per_tok=n_experts, intermediate_size=d_e, num_hidden_layers=n_layers)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        names = [n for n in src.names() if not n.startswith("model.layers.") or int(n.split(".")[2]) < n_layers]
        specs, plan = [], []  # (name, shape, dtype); (name, source name, rows | columns, scale)
        for name in names:
            if ".mlp." not in name:
                specs.append((name, tuple(src.shape(name)), "float32"))
                plan.append((name, name, None, None, 1))
                continue
            prefix, kind = name.split(".mlp.")
            kind = kind.split(".")[0]
            hf = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[kind]
            for e in range(n_experts):
                new = f"{prefix}.block_sparse_moe.experts.{e}.{hf}.weight"
                shape = (cfg["hidden_size"], d_e) if kind == "down_proj" else (d_e, cfg["hidden_size"])
                specs.append((new, shape, "float32"))
                plan.append((new, name, kind, e, n_experts if kind == "down_proj" else 1))
            if kind == "gate_proj":
                router = f"{prefix}.block_sparse_moe.gate.weight"
                specs.append((router, (n_experts, cfg["hidden_size"]), "float32"))
                plan.append((router, None, "router", None, 1))
        writer = SafetensorsWriter(out / "model.safetensors", specs, {"format": "pt"})
        held = (None, None)
        for new, name, kind, e, scale in plan:
            if kind == "router":
                w = np.zeros((n_experts, cfg["hidden_size"]), np.float32)
            else:
                if held[0] != name:
                    held = (name, np.asarray(src.read(name), dtype=np.float32))
                w = held[1]
                if kind == "down_proj":
                    w = w[:, e * d_e : (e + 1) * d_e] * np.float32(scale)
                elif kind is not None:
                    w = w[e * d_e : (e + 1) * d_e]
            writer.write(new, np.ascontiguousarray(w))
        writer.close()
        (out / "config.json").write_text(json.dumps(moe, indent=1))
        src.write_tokenizer(out)
    finally:
        src.close()
    return out
