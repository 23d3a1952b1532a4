"""Memory budget -> what stays resident, each layer's cache size, the window.

The budget counts the weights the process holds in DRAM: resident weights
(embeddings, attention, norms) in the compute dtype, the sparsity source's own
weights, every layer's neuron cache and the shared scratch rows that stream
neurons which do not fit a cache. "50%" means half of the model's weights in
the compute dtype (what `--mode dense` holds).

The rule without calibration statistics (`Req_i` arrives with calibration):
every layer gets the same capacity; one scratch of the same size streams the
overflow. With a window k, a layer whose cache is full shrinks its own window
(paper App. C.3/C.4).
"""

from dataclasses import dataclass

from ..errors import BudgetTooSmall, FlashError
from ..sizes import parse_share

from .config import DEFAULTS, MODES


def parse_budget(text, model_bytes):
    """'50%' (of the model's weights) or '4GB' / '512MiB' / a byte count -> bytes."""
    if text is None:
        return None
    kind, v = parse_share(text, "--memory-budget")
    return int(model_bytes * v) if kind == "fraction" else v


@dataclass
class Plan:
    mode: str
    budget_bytes: int | None
    resident_bytes: int  # attention, embeddings, norms (compute dtype)
    source_bytes: int  # the sparsity source's own weights
    neuron_bytes: int  # one neuron, every kind, compute dtype
    n_layers: int
    n_neurons: int
    capacity: int  # rows of each layer's cache
    scratch_rows: int  # rows of the shared streaming buffer
    window: int
    dip_capacity: tuple = (0, 0)  # (input dims, down rows) cached per layer, DIP sources
    dip_row_bytes: tuple = (0, 0)  # (one input dim's gate+up columns, one down row)
    dip_scratch: tuple = (0, 0)  # shared rows that stream what a layer's caches cannot hold
    capacities: list = None  # per-layer cache rows, when calibration measured Req_i
    held_neuron_bytes: int = 0  # one cached neuron held at float16 (0: caches at the compute dtype)
    arena_rows: int = 0  # float32 rows the held caches are converted into before use
    prefetch: bool = False  # naive / hybrid: two streaming buffers, the next layer read during this one

    def layer_capacity(self, layer):
        return self.capacities[layer] if self.capacities else self.capacity

    @property
    def ffn_dram_bytes(self):
        dip = sum((self.n_layers * c + sc) * b
                  for c, sc, b in zip(self.dip_capacity, self.dip_scratch, self.dip_row_bytes))
        caches = sum(self.capacities) if self.capacities else self.capacity * self.n_layers
        cache_bytes = caches * (self.held_neuron_bytes or self.neuron_bytes)
        return cache_bytes + (self.scratch_rows + self.arena_rows) * self.neuron_bytes + dip

    @property
    def weights_bytes(self):
        return self.resident_bytes + self.source_bytes + self.ffn_dram_bytes


def make_plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers,
              n_neurons, window=DEFAULTS.window, dip=None, req=None, held_neuron_bytes=0, prefetch=False,
              hold_most=False, align=1):
    """dip: (d_model, input-dim row bytes, n_ff, down row bytes, k_in, k_out) for the
    DIP sources: one shared scratch holds a token's k_in / k_out rows, and the
    two caches of every layer get the same fraction of their rows from the rest.
    req: (Req_i(k) for every layer, the most neurons one token needs), from calibration.
    held_neuron_bytes (dense, hybrid): the caches hold float16 rows, converted into a
    float32 arena of one cache before use (two with prefetch); arena + scratch then
    cost one float32 layer (two), and every layer's cache its float16 rows.
    prefetch (naive, hybrid): the streamed rows of the next layer are read while this
    layer computes, into a second streaming buffer (the scratch counts both).
    hold_most (hybrid, --mode auto): as many of every layer's neurons resident as the budget
    allows, up to all, where the paper's hybrid holds at most half.
    align (hybrid): the neurons held, a multiple of this (a quantized layout's group size: the
    down columns' sums of the held and the streamed rows then split between whole groups, which
    keeps hybrid's output dense's to the bit, models/ffn.py)."""
    if held_neuron_bytes and mode not in ("dense", "hybrid"):
        raise FlashError(f"float16 neuron caches are for --mode dense / hybrid, not {mode}")
    if mode not in MODES:
        raise FlashError(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
    fixed = resident_bytes + source_bytes
    n = n_neurons
    arena = 0
    if mode == "dense":
        capacity, scratch = n, 0
        arena = n if held_neuron_bytes else 0
    elif mode == "naive":
        capacity, scratch = 0, n * (2 if prefetch else 1)
    elif mode == "hybrid":
        capacity, scratch, arena = _hybrid_rows(budget_bytes, fixed, n, n_layers, neuron_bytes, held_neuron_bytes,
                                                prefetch, hold_most, align)
    elif dip is not None:
        return _dip_plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n, window, dip)
    elif req is not None:
        return _calibrated_plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n,
                                window, req)
    else:
        if budget_bytes is None:
            capacity, scratch = n, 0
        else:
            rows = (budget_bytes - fixed) // neuron_bytes
            per = rows // (n_layers + 1)
            capacity, scratch = min(n, per), min(n, per)
            if per < 1:
                raise budget_too_small(budget_bytes, fixed)
    plan = Plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n,
                capacity, scratch, window, held_neuron_bytes=held_neuron_bytes, arena_rows=arena,
                prefetch=prefetch and mode in ("naive", "hybrid"))
    return _check(plan, budget_bytes, mode)


def _hybrid_rows(budget_bytes, fixed, n, n_layers, neuron_bytes, held_neuron_bytes, prefetch, hold_most, align):
    """hybrid: (rows held a layer, streaming buffer rows, float32 arena rows). Half of every layer's
    FFN resident, the rest read every token; under a budget, the largest resident share it allows
    (the paper's hybrid holds half of the model in DRAM)."""
    bufs = 2 if prefetch else 1
    capacity = n if hold_most else n // 2
    if budget_bytes is not None and held_neuron_bytes:
        # float16 caches: as much of every layer as the budget allows, up to all of it;
        # cost: L * cap float16 rows + bufs arenas of cap + bufs buffers of n - cap
        # float32 rows (with prefetch, the next layer's cache is converted, and its
        # streamed rows read, while this layer computes)
        capacity = max(0, min(n, (budget_bytes - fixed - bufs * n * neuron_bytes)
                              // (n_layers * held_neuron_bytes)))
    elif budget_bytes is not None:
        rows = (budget_bytes - fixed) // neuron_bytes
        capacity = max(0, min(capacity, (rows - bufs * n) // max(n_layers - bufs, 1)))
    if capacity < n:
        capacity -= capacity % align
    return capacity, bufs * (n - capacity), bufs * capacity if held_neuron_bytes else 0


def _dip_plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n, window, dip):
    """The DIP sources' plan: one shared scratch holds a token's k_in / k_out rows, and the two
    caches of every layer get the same fraction of their rows from the rest."""
    fixed = resident_bytes + source_bytes
    d, in_bytes, n_ff, down_bytes, k_in, k_out = dip
    full = d * in_bytes + n_ff * down_bytes
    if budget_bytes is None:
        frac, scratch = 1.0, (0, 0)
    else:
        scratch = (k_in, k_out)
        frac = (budget_bytes - fixed - k_in * in_bytes - k_out * down_bytes) / n_layers / full
        if frac < 0:
            raise budget_too_small(budget_bytes, fixed + k_in * in_bytes + k_out * down_bytes)
    frac = min(frac, 1.0)
    return Plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n,
                0, 0, window, (int(frac * d), int(frac * n_ff)), (in_bytes, down_bytes), scratch)


def _calibrated_plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n, window, req):
    """Req_i (calibration, paper §3.3): layer i's cache is sized by what its window needs; a budget
    scales all of them down alike, and one scratch of a token's worth streams the overflow."""
    fixed = resident_bytes + source_bytes
    req, one_token = req
    if budget_bytes is None:
        caps, scratch = [min(n, r) for r in req], 0
    else:
        scratch = min(n, one_token)  # a token never needs more than cache + scratch
        rows = (budget_bytes - fixed) // neuron_bytes - scratch
        if rows < n_layers:
            raise budget_too_small(budget_bytes, fixed)
        scale = min(1.0, rows / max(sum(req), 1))
        caps = [max(1, min(n, int(r * scale))) for r in req]
    plan = Plan(mode, budget_bytes, resident_bytes, source_bytes, neuron_bytes, n_layers, n,
                0, scratch, window, capacities=caps)
    return _check(plan, budget_bytes, mode)


def _check(plan, budget_bytes, mode):
    if budget_bytes is not None and plan.weights_bytes > budget_bytes:
        raise over_budget(mode, plan.weights_bytes, budget_bytes)
    return plan


def over_budget(mode, need, budget):
    """The error for a plan of `mode` that needs `need` bytes of weights, over `budget`."""
    reason = f"--mode {mode} needs {need / 1e6:.1f} MB of weights in DRAM"
    return BudgetTooSmall(f"{reason}, over the budget of {budget / 1e6:.1f} MB" + ("; try --mode flash" if mode != "flash" else ""),
                          budget, need, reason)


def budget_too_small(budget, fixed):
    """The error for a budget below what must stay resident (`fixed`, plus at least a row)."""
    reason = (f"the resident weights alone (embeddings, attention, norms, sparsity source) take "
              f"{fixed / 1e6:.0f} MB")
    return BudgetTooSmall(f"memory budget {budget / 1e6:.0f} MB is too small: {reason}", budget, fixed, reason)
