"""--mode auto: the plan a run uses, chosen from the memory the weights may take.

- a sparsity option given (--sparsity, --density, --window, ...): flash, the only mode
  that is not exact (never chosen without being asked for);
- no --memory-limit or --memory-budget: dense, everything in DRAM;
- else among the exact plans that fit (dense; hybrid holding as many neurons a layer as the
  budget allows; naive; and for a float16 model computed in float32, dense and hybrid with
  their FFN rows held at float16, which fit twice the rows and convert them before use):
  - with this machine's profile cached (`mlx_flash.benchmark profile`), the one the cost
    model (plan/cost.py) predicts fastest;
  - without one, the one that reads the fewest bytes: the first that fits of dense, dense
    at float16, hybrid at float16, hybrid, naive. Not always the fastest (hybrid costs more
    per layer than naive, float16 rows compute slower than float32), which the log line says.
"""

from dataclasses import dataclass, field

from ..errors import BudgetTooSmall

EXACT_ORDER = ("dense", "hybrid", "naive")


def _label(mode, rows16):
    return mode + (" (float16 rows)" if rows16 else "")


@dataclass
class Candidate:
    mode: str
    rows16: bool = False  # its FFN rows in DRAM at float16 (a float16 model computed in float32)
    plan: object = None  # runtime.budget.Plan, None where it does not fit
    packed: bool = False  # its FFN rows held at their bits
    error: str = ""  # why it does not fit
    prediction: object = None  # cost.Prediction, where a profile is cached

    @property
    def label(self):
        return _label(self.mode, self.rows16)


@dataclass
class Choice:
    mode: str
    reason: str
    candidates: list = field(default_factory=list)
    rows16: bool = False

    @property
    def label(self):
        return _label(self.mode, self.rows16)

    def describe(self):
        return f"--mode auto: {self.label} ({self.reason})"


def variants(rows16):
    """The exact plans auto compares, in the order of the bytes they read (fewest first).
    rows16: the model can hold its FFN rows at float16 (dense and hybrid then come twice)."""
    if not rows16:
        return [Candidate(m) for m in EXACT_ORDER]
    return [Candidate("dense"), Candidate("dense", True), Candidate("hybrid", True), Candidate("hybrid"),
            Candidate("naive")]


def choose_mode(config, budget, plan_of, candidates=None, predict=None):
    """-> Choice. plan_of(candidate) -> its (plan, packed, staged), raising BudgetTooSmall
    where it does not fit; with none fitting, the last one's error (naive: the least DRAM).
    predict(candidate) -> its cost.Prediction, or None (no profile cached): the order decides."""
    given = config.sparse_options
    if given:
        return Choice("flash", f"{', '.join(given)} given: only flash mode reads a sparse subset")
    if budget is None:
        return Choice("dense", "no memory limit or budget: every weight in DRAM")
    candidates, last = candidates or variants(False), None
    for c in candidates:
        try:
            c.plan, c.packed, _ = plan_of(c)
        except BudgetTooSmall as e:
            c.error, last = e.reason, e
    fits = [c for c in candidates if c.plan is not None]
    if not fits:
        raise last
    if any(c.mode == "naive" for c in fits):  # (a hybrid holding no neuron: naive's reads, more parts)
        for c in fits:
            if c.mode == "hybrid" and c.plan.layer_capacity(0) == 0:
                c.plan, c.error = None, "it would hold no neuron (naive's reads, with a cache's parts)"
        fits = [c for c in fits if c.plan is not None]
    for c in fits:
        c.prediction = predict(c) if predict is not None else None
    if all(c.prediction is not None for c in fits):
        chosen = min(fits, key=lambda c: c.prediction.total_ms)
        others = ", ".join(f"{c.label} {c.prediction.total_ms:.0f}" for c in fits if c is not chosen)
        positions = chosen.prediction.positions
        unit = "ms/token" if positions == 1 else f"ms a decode step of {positions} sequences"
        reason = (f"the fastest predicted of the plans that fit the {budget / 1e6:.0f} MB for weights: "
                  f"{chosen.prediction.total_ms:.0f} {unit}" + (f"; {others}" if others else ""))
        if not all(c.prediction.batch_priced for c in fits):
            reason += (f"; the machine profile has no rates for a batch's step, so each is priced as {positions} "
                       "one-position steps (`mlx_flash.benchmark profile` measures them)")
    else:
        chosen = fits[0]
        skipped = candidates[: candidates.index(chosen)]
        why = "; ".join(f"{c.label}: {c.error}" for c in skipped)
        reason = (f"it reads the fewest bytes of the plans that fit the {budget / 1e6:.0f} MB for weights"
                  + (f" ({why})" if why else "")
                  + "; no machine profile is cached to predict their times: `mlx_flash.benchmark profile`")
    if chosen.mode == "hybrid":
        reason += f"; {chosen.plan.layer_capacity(0)} of {chosen.plan.n_neurons} neurons a layer held"
    return Choice(chosen.mode, reason, candidates, chosen.rows16)


def choose_exact(config, budget, plan_of, rows16, layout, resident_work, attention_read=(0, 0), batch=1):
    """--mode auto's Choice: the exact plans that fit (plan_of: a Candidate -> exact_plan's answer,
    from the runtime), each predicted by the cost model where this machine's profile is cached
    (never measured here), for a decode step of `batch` sequences. rows16: dense and hybrid are
    compared with their FFN rows held at float16 too."""
    from ..errors import FlashError
    from ..io.reader import DEFAULT_MAX_READ
    from .cost import exact_work, predict
    from .profile import load_profile

    profile = load_profile() if budget is not None else None

    def predict_of(c):
        if profile is None:
            return None
        try:
            return predict(exact_work(c.plan, layout, c.packed, resident_work, DEFAULT_MAX_READ, attention_read,
                                      bundled=config.bundled, positions=batch), profile)
        except FlashError:  # (a profile without this weight form's rate)
            return None

    return choose_mode(config, budget, plan_of, variants(rows16), predict_of)
