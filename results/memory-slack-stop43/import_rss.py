"""What importing mlx_lm costs in RSS, and what a tokenizer load adds: mlx_lm as it is (its
package import pulls in transformers) against its model modules alone (the package's __init__
not run) with the `tokenizers` library's tokenizer. Not how mlx_flash loads anything: a
measurement of the lever, stop 43.

usage: .venv/bin/python results/memory-slack-stop43/import_rss.py {stub,full}   (one process each)"""
import sys, importlib.util
def rss(): 
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])//1024
mode = sys.argv[1]
import mlx.core as mx, numpy
a = rss()
if mode == 'stub':
    spec = importlib.util.find_spec('mlx_lm')
    m = importlib.util.module_from_spec(spec); sys.modules['mlx_lm'] = m
    import mlx_lm.models.llama, mlx_lm.models.cache
    import tokenizers, jinja2
    b = rss()
    t = tokenizers.Tokenizer.from_file('models/smollm2-135m-instruct/tokenizer.json')
    ids = t.encode("Hello there, how are you?").ids
else:
    import mlx_lm.models.llama
    from mlx_lm.tokenizer_utils import load as lt
    from pathlib import Path
    b = rss()
    t = lt(Path('models/smollm2-135m-instruct'))
    ids = t.encode("Hello there, how are you?")
c = rss()
import mlx_flash.loader
d = rss()
print(mode, 'mlx+np', a, 'imports', b, 'tokenizer', c, 'mlx_flash.loader', d, 'scipy' in sys.modules)
