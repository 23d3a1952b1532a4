"""The per-token runtime: where every FlashFFN gets its rows, and the one place that builds it.

    config.py   FlashConfig: every run-time option, its default and check (load()'s keywords,
                the CLI's model arguments)
    build.py    manifest + config -> Runtime (budget -> plan, source, reader, store), `model.runtime`
    budget.py   memory budget -> Plan: what stays resident, each layer's cache, the window
    stats.py    per-token statistics (the paper's Table 3 columns)
    stores/     base.py (what every store shares), dense.py, streamed.py (naive / hybrid),
                flash.py (windowed neuron caches), dip.py (DIP / DIP-CA), attention.py (quantized
                attention read from the resident file every token, when the budget leaves no room),
                embedding.py (the input embedding's rows read from the resident file, an untied table),
                head.py (the output head read from the resident file every pass, chunk by chunk),
                kv.py (the KV cache on flash), experts.py (a mixture's experts in an expert buffer)
    moe.py      a mixture of experts' runtime: the expert buffer from the budget, its store

May import: errors, sizes, io, kernels, cache, layout, models.ffn / models.half, sparsity. Never
the loader, the CLI or the benchmarks. Outside this package only this module's names
are used (no file outside runtime/ imports a store).
"""

from .build import (DTYPES, ResidentWeights, Runtime, attention_to_stream, build_runtime, check_resident_fits,
                    compute_dtype, dense_need, dip_flash, embedding_on_flash, embedding_to_stream, head_may_stream,
                    head_on_flash, loaded_resident_bytes, may_hold_float16, rebuild_runtime)
from .config import FlashConfig, add_cli_args, from_cli, keep_quantized, make_config
from .stores.base import TooManyNeurons, cpu_kernels, read_layer_bytes, read_layer_file

__all__ = ["DTYPES", "FlashConfig", "Runtime", "ResidentWeights", "TooManyNeurons", "add_cli_args",
           "attention_to_stream", "build_runtime", "embedding_on_flash", "embedding_to_stream", "head_may_stream",
           "head_on_flash",
           "loaded_resident_bytes",
           "check_resident_fits", "compute_dtype", "dense_need", "dip_flash", "from_cli", "keep_quantized", "make_config",
           "may_hold_float16", "rebuild_runtime", "cpu_kernels", "read_layer_bytes", "read_layer_file"]
