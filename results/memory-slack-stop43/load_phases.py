"""A --memory-limit load's phases, one process: the plan, the load's peak RSS (VmHWM), the RSS
and MLX's memory after the load, after each prompt chunk (the last token apart, as mlx_lm's
prefill does), after the last token's logits and after 8 decode steps.

usage: .venv/bin/python results/memory-slack-stop43/load_phases.py MODEL LIMIT PROMPT_TOKENS"""
import sys, mlx_flash, mlx.core as mx
from mlx_flash.runtime.memory import process_rss
from mlx_lm.models.cache import make_prompt_cache
model, tok = mlx_flash.load(sys.argv[1], memory_limit=sys.argv[2], ctx_size=int(sys.argv[3])+20)
m = model.runtime.memory
print("plan: weights", m.weights>>20, "baseline", m.baseline>>20, "step", m.prefill_step, "held", model.runtime.stats()["summary"].get("weights_in_dram_bytes",0)>>20)
from mlx_flash.runtime.memory import peak_rss; print("load peak", peak_rss()>>20)
print("after load RSS", process_rss()>>20, "MLX active", mx.get_active_memory()>>20, "cache", mx.get_cache_memory()>>20)
n = int(sys.argv[3])
ids = tok.encode("The history of the domestic cat begins in the Near East. " * 60)[:n]
cache = model.make_cache() if hasattr(model, "make_cache") else make_prompt_cache(model)
for i in range(0, n-1, m.prefill_step):
    out = model(mx.array([ids[i:min(i+m.prefill_step, n-1)]]), cache=cache); mx.eval([c.state for c in cache])
    print(" chunk RSS", process_rss()>>20, "MLX active", mx.get_active_memory()>>20, "cache", mx.get_cache_memory()>>20, "peak", mx.get_peak_memory()>>20)
lg = model(mx.array([ids[-1:]]), cache=cache)[:, -1]; mx.eval(lg)
print("after last logits RSS", process_rss()>>20, "MLX active", mx.get_active_memory()>>20, "cache", mx.get_cache_memory()>>20, "peak", mx.get_peak_memory()>>20)
for _ in range(8):
    t = int(mx.argmax(lg).item()); lg = model(mx.array([[t]]), cache=cache)[:, -1]; mx.eval(lg)
print("after decode RSS", process_rss()>>20, "MLX active", mx.get_active_memory()>>20, "cache", mx.get_cache_memory()>>20, "peak", mx.get_peak_memory()>>20)
