"""--explain: the plan a run is about to use, and with --mode auto every mode it compared,
each with the weights it holds, the bytes it reads and the cost model's predicted time."""

from .profile import load_profile


def explain(runtime, profile=None):
    """profile: the machine's (plan/profile.py); without one (none cached) the table says what
    each mode holds and reads, and no time."""
    profile = profile or load_profile()
    choice, plan = runtime.choice, runtime.plan
    lines = ["[mlx_flash] plan: " + (choice.describe() if choice is not None else f"--mode {runtime.mode}")]
    batch = runtime.batch  # (a --memory-limit plan for a batch: priced by its decode step)
    rows = [("mode", "weights in DRAM", "read per token" if batch == 1 else "read per step",
             "predicted per token" if batch == 1 else f"predicted per step of {batch} sequences")]
    candidates = choice.candidates if choice is not None and choice.candidates else []
    if candidates:
        for c in candidates:
            if c.plan is None:
                rows.append((c.label, "does not fit: " + c.error, "", ""))
                continue
            rows.append(_row(runtime, profile, c.label, c.plan, c.packed, c.label == choice.label))
    else:
        rows.append(_row(runtime, profile, runtime.mode, plan, None, True))
    widths = [max(len(r[i]) for r in rows if r[2] or i == 0) for i in range(4)]
    for r in rows:
        if not r[2] and r[1].startswith("does not fit"):
            lines.append(f"  {r[0]:<{widths[0]}}  {r[1]}")
        else:
            lines.append("  " + "  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip())
    att = getattr(runtime, "attention", None)
    if att is not None:
        lines.append(f"  (the attention of {len(att.order)} of {len(runtime.ffns)} layers, {att.streamed_bytes / 1e6:.0f} MB, "
                     f"is read from flash every token into {len(att.buffers)} buffer(s) of "
                     f"{att.buffers[0].nbytes / 1e6:.0f} MB: counted in each plan's reads and weights)")
    emb = getattr(runtime, "embedding", None)
    if emb is not None:
        lines.append(f"  (the input embeddings, {emb.streamed_bytes / 1e6:.0f} MB, are read from flash: a token "
                     f"reads its row, {emb.span.row_bytes} bytes, into buffers of {emb.weights_bytes / 1e6:.1f} MB "
                     "with their checksums; the table is not held in DRAM)")
    elif getattr(runtime, "tied_embeddings", False) and runtime.budget_bytes is not None:
        lines.append("  (the input embeddings are tied to the output head, which multiplies by every row each "
                     "token: the table stays whole in DRAM)")
    if profile is None:
        lines.append("  (no machine profile is cached, so no predicted times: `mlx_flash.benchmark profile` "
                     "measures one; generate --explain does it by itself)")
    else:
        lines.append(f"  (cost model: plan/cost.py; profile of {profile.machine}, measured {profile.measured}"
                     f"{', quick probe' if profile.quick else ''}: mlx_flash.benchmark profile measures it again)")
    return "\n".join(lines)


def _row(runtime, profile, mode, plan, packed, chosen):
    work = runtime.work(plan, packed, runtime.batch)
    weights = f"{plan.weights_bytes / 1e6:.0f} MB" + (" <- chosen" if chosen else "")
    if work is None:
        return mode, weights, "depends on the sparsity", "not modelled (flash mode)"
    if profile is None:
        return mode, weights, f"{work.read_bytes / 1e6:.1f} MB", "(no profile)"
    from .cost import predict

    p = predict(work, profile)
    return mode, weights, f"{work.read_bytes / 1e6:.1f} MB", p.describe()
