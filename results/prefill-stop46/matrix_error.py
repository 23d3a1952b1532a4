"""One 4-bit matrix (group 32) times 20 positions, error relative to float64 on the dequantized
values: the pass kernels' tiles (QuantMatrix.matmul), float32 BLAS on the dequantized values,
MLX's quantized_matmul (mlx_lm's), and the one-position kernel (qmv) position by position.

usage: .venv/bin/python results/prefill-stop46/matrix_error.py
"""
import mlx_flash, numpy as np, mlx.core as mx
from mlx_flash import kernels as K
from mlx_flash.kernels import QuantMatrix
module, _ = K.kernels_module()
rng = np.random.default_rng(0)
for (n, k) in ((1536, 576), (576, 1536), (49152, 576)):
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    wd = np.array(mx.dequantize(wq, s, b, group_size=32, bits=4)).astype(np.float64)
    x = rng.standard_normal((20, k)).astype(np.float32)
    want = x.astype(np.float64) @ wd.T
    q = QuantMatrix(module, wq, s, b, 4, 32)
    tiles = q.matmul(x)
    blas = np.array(mx.array(x) @ mx.array(wd.astype(np.float32)).T)
    mlxq = np.array(mx.quantized_matmul(mx.array(x), wq, s, b, transpose=True, group_size=32, bits=4))
    one = np.stack([ (lambda o: (q.matvec(x[i], o), o)[1])(np.empty(n, np.float32)) for i in range(20)])
    sc = np.abs(want).max()
    print(n, k, f"tiles {np.abs(tiles-want).max()/sc:.1e} blas {np.abs(blas-want).max()/sc:.1e} mlx_q {np.abs(mlxq-want).max()/sc:.1e} qmv {np.abs(one-want).max()/sc:.1e}  tiles-vs-blas {np.abs(tiles-blas).max()/sc:.1e} mlxq-vs-blas {np.abs(mlxq-blas).max()/sc:.1e}")
