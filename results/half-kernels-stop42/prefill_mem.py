# ad hoc (stop 42, kept): peak RSS growth of a prompt's prefill by chunk size (float16 SmolLM2, dense, held at float16)
import sys, os
import mlx.core as mx
from mlx_flash import load, generate
from mlx_flash.runtime.memory import process_rss, peak_rss
step = int(sys.argv[1]); model_path = sys.argv[2]; mode = sys.argv[3] if len(sys.argv) > 3 else "dense"
mx.set_cache_limit(32 << 20)
model, tok = load(model_path, mode=mode, resident_dtype="float16")
prompt = open("/work/main/README.md").read()[:4000]
ids = tok.encode(prompt)[:600]
r0 = process_rss(); 
# reset HWM
open("/proc/self/clear_refs", "w").write("5")
out = generate(model, tok, ids, max_tokens=2, prefill_step_size=step)
print(f"step {step}: rss after load {r0/1e6:.0f} MB, peak growth {(peak_rss()-r0)/1e6:.0f} MB, mlx peak {mx.get_peak_memory()/1e6:.0f} MB, prompt {len(ids)}")
