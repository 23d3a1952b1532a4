"""Which kernels a pass of several positions goes through: the one-position kernels position
by position (up to SMALL_PASS), the pass kernels' tiles (a batch's decode step up to
BATCH_PASS sequences; a prompt's chunk up to PROMPT_PASS positions, off by default) where
the CPU runs them (batched), else dequantized chunks + BLAS, said once (pass_kernels).

BATCH_PASS and PROMPT_PASS are read here when a pass runs: set them on this module."""

SMALL_PASS = 4  # passes of up to this many positions (a speculative verify pass, a batch's decode step)
# run the one-position kernels position by position, resident weights and FFN rows alike:
# dequantizing a whole matrix for BLAS (the output head's 28 M values for SmolLM2) costs more than
# that many matrix-vector products, and each position's values are then a one-position pass's


BATCH_PASS = 256  # a batch's decode step of up to this many sequences multiplies each row, dequantized once,
# into every sequence's position (qmm, qmm_rows, qmm_cols; 16-bit rows converted once: gather_mm,
# gather_mm_cols) where the CPU runs their AVX-512 or AVX2
# tiles (pass_kernels); more sequences, and a prompt chunk of more than one position a sequence,
# dequantize chunks for BLAS (MLX's order of sums). 256, not 32: a 4-bit step of 64 sequences
# through the tiles consumes a 7B FFN matrix at 0.97 GB/s here, through chunks + BLAS at 0.50;
# of 128, 0.52 against 0.33 (benchmarks/batch/tiles/pass_vs_blas.txt; a step of 64 prompts of
# OPT-6.7B 5.1 s against 9.7, batch64_cap.txt there). The
# step's temporaries (x transposed in C, the FFN's hidden states on the host: ~4 x positions x
# d_ff floats) are counted by a --memory-limit plan for its batch (runtime/memory.py
# activation_bytes)


def batched(module):
    """Whether the pass kernels (qmm*) run their tiles here: SIMD level 1 (AVX2 + FMA) or 2 (AVX-512
    BF16), the same bits at both. At level 0 (other CPUs, or the portable loops asked for) they
    would run loops slower than dequantized chunks + BLAS: the callers take BLAS."""
    return module is not None and module.simd(-1) >= 1


_SAID = set()  # the reasons a batch's step went through BLAS, said once a process


_QUIET = []  # pass_notes_off's, while one is open


class pass_notes_off:
    """Within it, pass_kernels says nothing (the machine profile times BLAS's batch steps on
    purpose): the reasons stay unsaid for the process's later batches."""

    def __enter__(self):
        _QUIET.append(self)
        return self

    def __exit__(self, *exc):
        _QUIET.remove(self)


PROMPT_PASS = 0  # set it to up to BATCH_PASS, and a prompt's chunk of more than SMALL_PASS and up to that many
# positions goes through the pass kernels' tiles too, where batched(). Off by default: the parity rule (a
# prompt's logits within 1e-4 of mlx_lm's on the same weights; tests/test_quant.py's Q4_1 SmolLM2) holds
# through dequantized chunks + BLAS (1.6e-5) but not through the tiles (8.9e-4; MLX's own quantized
# kernel is 6.7e-4 away, the decode's one-token kernels 5.9e-4). At 256, a 4-bit OPT-6.7B prompt in
# --mode dense reaches its first token in 2.5 s at 16 tokens, 10.2 at 128 and 20.5 at 256, against 6.5,
# 15.1 and 23.5 through BLAS (benchmarks/prompt-tiles/). Read when a chunk runs, and by a
# --memory-limit plan at load (runtime/memory.py activation_bytes)


def pass_kernels(module, x):
    """Whether the pass kernels take x (an MLX activation [..., positions, d]): one position a
    sequence (a batch's decode step, or a prefill chunk one position wide) for more than
    SMALL_PASS and at most BATCH_PASS sequences, or a prompt's chunk of more than SMALL_PASS and
    at most PROMPT_PASS positions, where batched(module). A batch's step they do not take says
    why, once."""
    positions = x.size // x.shape[-1]
    if not (positions > SMALL_PASS and x.ndim >= 2):
        return False
    if x.shape[-2] > 1:  # a prompt's chunk
        return positions <= PROMPT_PASS and batched(module)
    why = (f"{positions} sequences, more than the {BATCH_PASS} they take" if positions > BATCH_PASS else
           None if batched(module) else "the pass kernels run on x86 with AVX2 or AVX-512 only (SIMD level "
           f"{module.simd(-1) if module is not None else 0} here)")
    if why is not None and why not in _SAID and not _QUIET:
        _SAID.add(why)
        import logging

        logging.getLogger("mlx_flash").warning(
            "a batch's decode step multiplies its weights through float32 chunks + BLAS, not the "
            "pass kernels: %s", why)
    return why is None
