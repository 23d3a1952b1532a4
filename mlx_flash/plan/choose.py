"""--mode auto: the mode a plan runs, chosen from the memory the weights may take.

- a sparsity option given (--sparsity, --density, --window, ...): flash, the only mode
  that is not exact (never chosen without being asked for);
- no --memory-limit or --memory-budget: dense, everything in DRAM;
- else the first of dense, hybrid, naive whose plan fits.

Why an order and not a search over predicted times: the exact modes compute the same rows
and differ in how many stay in DRAM, so the one that holds the most (dense, then hybrid with
the largest cache the budget allows, then naive) reads the fewest bytes. That is not always
the fastest: hybrid computes its held and streamed rows as two parts and costs more per
layer, and on SmolLM2 at 35 % naive measured as fast (results/plan/). The cost model
(plan/cost.py) predicts each candidate's time for --explain and --stats, but it does not yet
model how much prefetch hides on this machine, so it does not decide.
"""

from dataclasses import dataclass, field

from ..errors import BudgetTooSmall

EXACT_ORDER = ("dense", "hybrid", "naive")


@dataclass
class Candidate:
    mode: str
    plan: object = None  # runtime.budget.Plan, None where it does not fit
    packed: bool = False  # its FFN rows held at their bits
    error: str = ""  # why it does not fit


@dataclass
class Choice:
    mode: str
    reason: str
    candidates: list = field(default_factory=list)

    def describe(self):
        return f"--mode auto: {self.mode} ({self.reason})"


def choose_mode(config, budget, plan_of):
    """-> Choice. plan_of(mode) -> the exact mode's (plan, packed, staged), raising
    BudgetTooSmall where it does not fit; with none fitting, naive's error (the least DRAM)."""
    given = config.sparse_options
    if given:
        return Choice("flash", f"{', '.join(given)} given: only flash mode reads a sparse subset")
    if budget is None:
        return Choice("dense", "no memory limit or budget: every weight in DRAM")
    candidates, last = [], None
    for mode in EXACT_ORDER:
        try:
            plan, packed, _ = plan_of(mode)
            candidates.append(Candidate(mode, plan, packed=packed))
        except BudgetTooSmall as e:
            candidates.append(Candidate(mode, error=e.reason))
            last = e
    fits = [c for c in candidates if c.plan is not None]
    if not fits:
        raise last
    chosen = fits[0]
    skipped = candidates[: candidates.index(chosen)]
    why = "; ".join(f"{c.mode}: {c.error}" for c in skipped)
    reason = (f"it fits the {budget / 1e6:.0f} MB for weights" + (f" ({why})" if why else "")
              + ("" if chosen.mode == "dense" else
                 f"; {chosen.plan.layer_capacity(0)} of {chosen.plan.n_neurons} neurons a layer held"))
    return Choice(chosen.mode, reason, candidates)
