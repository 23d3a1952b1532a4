"""`mlx_flash.benchmark moe`: a mixture of experts of a real shape (Qwen3-30B-A3B, Mixtral-8x7B)
with random 4-bit weights, decoded under an expert buffer of a share of the model (EdgeMoE's
rows): naive (a buffer of one layer's routed experts: every expert read every token), the
buffer with LRU, LFU and EdgeMoE's eviction, EdgeMoE's with the router look-ahead reading
the next layer's experts during this layer's compute (+lookahead), with a layer's missing
experts read while its cached ones compute (+overlap), and with both (the runtime's default).
Belady's hit rate, the offline optimum, is replayed on the routing the runs recorded. Rows
alternate within each round; medians.

Routing is the random model's own (its routers on its residual stream): close to uniform over
the experts, so hit rates and the look-ahead's precision here are a pessimistic stand-in for a
trained model's, whose routing is skewed and correlated across layers (EdgeMoE §2.3, Fig. 4).
"""

import json
import time
from pathlib import Path

import numpy as np

from ..runtime.stats import hidden_share

ROWS = ("naive", "lru", "lfu", "edgemoe", "edgemoe+lookahead", "edgemoe+overlap", "edgemoe+lookahead+overlap")
ROUTINGS = ("trace", "model")


class RoutingTrace:
    """A trained MoE's routing, as a generator: each layer prefers some experts (popularity
    ~ Zipf(skew) over a random order per layer), a token often keeps an expert the previous
    token chose at the same layer (`stay`), and a choice at layer l often implies one at l + 1
    (`follow`: a fixed random map per layer pair) — the three regularities measured on real
    models: skewed, power-law activation paths and cross-layer correlation (EdgeMoE §2.3 and
    §3.3.2, Fig. 4 and 8), and consecutive tokens routed to the same expert more often than
    chance (Mixtral of Experts, Jiang et al. 2024, §5). The parameters are chosen to be of that
    order, not fitted to a trace. `seed` makes the model (popularities, maps), `tokens` the tokens
    drawn from it: deterministic for both."""

    def __init__(self, n_layers, n_experts, k, seed=0, tokens=0, skew=0.8, stay=0.3, follow=0.4):
        self.n_layers, self.n_experts, self.k = n_layers, n_experts, k
        self.stay, self.follow = stay, follow
        rng = np.random.default_rng([seed, 1])
        ranks = np.arange(1, n_experts + 1, dtype=np.float64) ** -skew
        self.popularity = np.stack([ranks[rng.permutation(n_experts)] / ranks.sum() for _ in range(n_layers)])
        self.maps = np.stack([rng.permutation(n_experts) for _ in range(n_layers)])
        self.rng = np.random.default_rng([seed, 2, tokens])
        self.previous = [None] * n_layers  # the last token's experts at each layer
        self.below = None  # this token's experts at the layer before

    def choose(self, layer):
        """One token's k distinct experts at `layer`."""
        rng, out = self.rng, []
        for j in range(self.k):
            r = rng.random()
            if r < self.stay and self.previous[layer] is not None:
                e = int(self.previous[layer][j])
            elif r < self.stay + self.follow and layer > 0 and self.below is not None:
                e = int(self.maps[layer - 1][self.below[j]])
            else:
                e = int(rng.choice(self.n_experts, p=self.popularity[layer]))
            while e in out:
                e = int(rng.choice(self.n_experts, p=self.popularity[layer]))
            out.append(e)
        out = np.array(out)
        self.previous[layer], self.below = out, out
        return out

    def paths(self, tokens):
        """`tokens` tokens' expert paths (calibration for the path predictor)."""
        return [[self.choose(layer) for layer in range(self.n_layers)] for _ in range(tokens)]


def drive_routing(model, trace, predictor=None, width=None):
    """Route every MoE block of `model` by `trace` (weights 1/k) instead of its router; with a
    predictor (sparsity/expert_paths.py), the look-ahead guesses from it instead of the next router:
    its `width` (default k) most likely experts of the next layer."""
    width = width or trace.k
    import mlx.core as mx

    for i, layer in enumerate(model.layers):
        block = layer[layer.block_name]
        if not hasattr(block, "route"):
            continue

        def route(x, layer=i):
            positions = x.shape[:-1]
            n = int(np.prod(positions))
            inds = np.stack([trace.choose(layer) for _ in range(n)]).reshape(*positions, trace.k)
            return mx.array(inds.astype(np.int32)), mx.full(inds.shape, 1.0 / trace.k, dtype=x.dtype)

        block.route = route
        if predictor is not None and block.experts.lookahead is not None:
            nxt = block.experts.lookahead[0]
            block.experts.lookahead = (nxt, lambda residual, inds, layer=i: predictor.predict(
                layer, np.array(inds), width)[None])


def _row_options(row, budget_bytes, top_k_bytes):
    """load() options of a row."""
    if row == "naive":  # one layer's routed experts: nothing survives to the next token
        return dict(memory_budget=str(top_k_bytes), expert_eviction="lru", prefetch=False)
    policy, *features = row.split("+")
    return dict(memory_budget=str(budget_bytes), expert_eviction=policy, prefetch="lookahead" in features,
                overlap="overlap" in features)


COUNTERS = ("io_s", "read_s", "wait_s", "prefetch_s", "bytes", "prefetched_bytes", "asked", "hits",
            "predicted", "predicted_used", "cancelled")  # the ExpertStats a measured token is charged with


def _counters(stats):
    return np.array([float(np.sum(getattr(stats, c))) for c in COUNTERS])


def _decode(model, prompt, tokens, warmup):
    """Sampled decode after `prompt` -> per measured token: (seconds, {counter: its change})."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.random.seed(0)  # sampled, not greedy: a random model's greedy tokens fall into a loop
    y = mx.random.categorical(model(mx.array([prompt]), cache=cache)[:, -1])
    mx.eval(y)
    stats = model.runtime.store.stats
    out = []
    for i in range(warmup + tokens):
        before = _counters(stats)
        t0 = time.perf_counter()
        y = mx.random.categorical(model(y[None], cache=cache)[:, -1])
        mx.eval(y)
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append((dt, dict(zip(COUNTERS, _counters(stats) - before))))
    return out


def _sizes(folder, lay, top_k, n_files):
    """The model's bytes as the runtime holds them (what a share is of) and a slot's, from the
    refusal of a budget of one byte (nothing of the experts read) -> (resident, slot, model bytes)."""
    import mlx.core as mx

    import mlx_flash
    from ..errors import BudgetTooSmall
    from ..runtime.moe import slot_bytes

    slot = slot_bytes(lay, mx.float32)
    try:
        mlx_flash.load(folder, memory_budget="1")
        raise AssertionError("a budget of 1 byte was accepted")
    except BudgetTooSmall as e:
        resident = e.needed - top_k * slot
    model_bytes = resident + n_files * lay.n_experts * slot
    mx.clear_cache()
    return resident, slot, model_bytes


def _measure_row(folder, options, routing, n_all, lay, top_k, predictor, lookahead_width, prompt, tokens, warmup):
    """One row's model loaded, its routing driven (trace routing: the same for every row and
    round), its tokens decoded and measured, the model closed -> (its slots, the measured tokens,
    the experts it asked for)."""
    import mlx.core as mx

    import mlx_flash

    model, _ = mlx_flash.load(folder, **options)
    model.runtime.store.stats.trace = []  # (recorded for the offline policies)
    if routing == "trace":  # the same routing for every row and round
        drive_routing(model, RoutingTrace(n_all, lay.n_experts, top_k), predictor, lookahead_width)
    slots = model.runtime.store.slots
    measured = _decode(model, prompt, tokens, warmup)
    trace = list(model.runtime.store.stats.trace)
    model.runtime.close()
    del model
    mx.clear_cache()
    return slots, measured, trace


def _table_row(budget, row, res, gbps):
    """A row of the table: the medians of its measured tokens (rates over all of them), its floor
    at the disk's `gbps`."""
    dt = np.median([t for t, _ in res["tokens"]])

    def median(c):
        return float(np.median([d[c] for _, d in res["tokens"]]))

    def total(c):  # (rates over all measured tokens)
        return float(sum(d[c] for _, d in res["tokens"]))

    io, read, wait, pre_s = median("io_s"), median("read_s"), median("wait_s"), median("prefetch_s")
    read_bytes = median("bytes") + median("prefetched_bytes")
    asked, pred = total("asked"), total("predicted")
    return {"budget": budget, "row": row, "slots": res["slots"], "ms_per_token": 1e3 * dt,
            "tokens_per_s": 1 / dt, "io_ms": 1e3 * (io + wait), "compute_ms": 1e3 * (dt - io - wait),
            "read_mb_per_token": read_bytes / 1e6, "hit_rate": total("hits") / asked if asked else None,
            "floor_ms": 1e3 * read_bytes / (gbps * 1e9), "predicted": pred,
            "precision": total("predicted_used") / pred if pred else None,
            "cancelled": total("cancelled"),
            "hidden_share": hidden_share(io, read, wait, pre_s)}


def run_moe_bench(shape="qwen3-30b-a3b", budgets=("25%", "50%"), tokens=8, rounds=2, warmup=4,
                  rows=ROWS, out="out/moe", progress=True, home=None, routing="trace", lookahead_width=None):
    from ..errors import FlashError

    if lookahead_width is not None and (routing != "trace" or lookahead_width < 1):
        raise FlashError("lookahead_width: a positive number, with trace routing (the model's routers' look-ahead "
                         "guesses its top-k)")
    from ..convert.random_model import build_checkpoint, shape_config
    from ..layout.format import read_manifest
    from ..plan.measure import disk_curve
    from ..runtime.budget import parse_budget

    t0 = time.perf_counter()
    folder = build_checkpoint(shape, "q4", home=home, progress=progress)
    build_s = time.perf_counter() - t0
    manifest = read_manifest(folder)
    lay = manifest.experts["layout"]
    files = [folder / e["file"] for e in manifest.experts["files"] if e is not None]
    disk_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    cfg = shape_config(shape)
    top_k = cfg["num_experts_per_tok"]
    prompt = [1, 2, 3, 4]
    resident, slot, model_bytes = _sizes(folder, lay, top_k, len(files))
    n_all = len(manifest.experts["files"])  # (layers; ids are layer * n_experts + expert)
    disk = {"at_start": disk_curve(files[:4], [lay.stride], seconds=2.0)[lay.stride]}
    predictor = None
    if routing == "trace":  # EdgeMoE's path statistics, from other tokens of the same generator
        from ..sparsity.expert_paths import ExpertPathPredictor

        calib = RoutingTrace(n_all, lay.n_experts, top_k, tokens=1)
        predictor = ExpertPathPredictor(n_all, lay.n_experts).fit(calib.paths(2048))
    results = {}
    for budget in budgets:
        budget_bytes = parse_budget(budget, model_bytes)
        for r in range(rounds):
            order = list(rows) if r % 2 == 0 else list(reversed(rows))
            for row in order:
                options = _row_options(row, budget_bytes, resident + top_k * slot)
                slots, measured, trace = _measure_row(folder, options, routing, n_all, lay, top_k, predictor,
                                                      lookahead_width, prompt, tokens, warmup)
                results.setdefault((budget, row), {"slots": slots, "tokens": [], "trace": trace})["tokens"] += measured
                if progress:
                    ms = 1e3 * np.median([t for t, _ in measured])
                    print(f"[moe] {shape} {budget} {row}: {ms:.0f} ms/token ({slots} slots)", flush=True)
    disk["at_end"] = disk_curve(files[:4], [lay.stride], seconds=2.0)[lay.stride]
    gbps = min(disk.values())
    table = [_table_row(budget, row, res, gbps) for (budget, row), res in results.items()]
    simulated = _simulate(results, n_all, lay, top_k)
    naive = {e["budget"]: e["ms_per_token"] for e in table if e["row"] == "naive"}
    for e in table:
        e["vs_naive"] = naive[e["budget"]] / e["ms_per_token"] if e["budget"] in naive else None  # (no naive row run)
    report = {"shape": shape, "folder": str(folder), "disk_bytes": disk_bytes, "build_s": build_s,
              "model_bytes": model_bytes, "resident_bytes": resident, "slot_bytes": slot,
              "expert_bytes_on_flash": lay.bundle_bytes, "n_experts": lay.n_experts, "top_k": top_k,
              "disk_gbps_at_expert_size": disk, "tokens": tokens, "rounds": rounds, "warmup": warmup,
              "routing": routing, "lookahead_width": lookahead_width or top_k,
              "rows": table, "simulated_hit_rates": simulated}
    _write(report, Path(out))
    return report


def _simulate(results, n_layers, lay, top_k):
    """{budget: {policy: hit rate}}: every policy, Belady's offline optimum among them, replayed on
    the routing one run of that budget recorded (its decode tokens, warm-up included; the routing
    does not depend on the buffer, so every row of a budget saw the same), at its slot count."""
    from ..cache.eviction import POLICIES, EdgeMoE, simulate_hits

    n_ids = n_layers * lay.n_experts
    out = {}
    for (budget, row), res in results.items():
        if row != "lru":
            continue
        # a decode step's experts (a prompt's steps may want more than the slots)
        ids = [layer * lay.n_experts + np.asarray(e) for layer, e in res["trace"] if len(e) <= top_k]
        policies = {"lru": POLICIES["lru"](n_ids), "lfu": POLICIES["lfu"](n_ids),
                    "edgemoe": EdgeMoE(n_ids, lay.n_experts, n_layers), "belady": POLICIES["belady"](n_ids, ids)}
        out[budget] = {"slots": res["slots"], "steps": len(ids)} | {
            name: simulate_hits(p, ids, res["slots"]) for name, p in policies.items()}
        # the same slots split evenly over the layers (a buffer per layer) instead of pooled, LRU in each
        per = res["slots"] // n_layers
        hits = total = 0
        for layer in range(n_layers):
            sub = [i for i in ids if i.size and i[0] // lay.n_experts == layer]
            if sub and per >= max(i.size for i in sub):
                rate = simulate_hits(POLICIES["lru"](n_ids), sub, per)
                hits, total = hits + rate * sum(i.size for i in sub), total + sum(i.size for i in sub)
        out[budget]["lru_per_layer"] = hits / total if total else None
    return out


ROUTING_TEXT = {
    "trace": ("a trace model (RoutingTrace: per-layer Zipf(0.8) popularity, 30 % of choices kept from the previous "
              "token, 40 % following the previous layer's through a fixed map; of the order EdgeMoE §2.3/§3.3.2 and "
              "Mixtral §5 report, not fitted), the same for every row; the look-ahead guesses from EdgeMoE's path "
              "statistics (sparsity/expert_paths.py) fitted on 2048 other tokens of the generator."),
    "model": ("the random model's own routers: a random model routes a token much as the one before it, so the "
              "hit rates are flattering and the router look-ahead's guesses near chance; see --routing trace."),
}


def _write(report, out):
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"moe-{report['shape']}-q4-{report['routing']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    d = report["disk_gbps_at_expert_size"]
    lines = [f"# benchmark moe: {report['shape']}, random 4-bit weights (group 64)", "",
             f"Checkpoint {report['folder']}: {report['disk_bytes'] / 1e9:.1f} GB on disk (built in "
             f"{report['build_s']:.0f} s, reused after); {report['n_experts']} experts a layer, top-{report['top_k']}, "
             f"{report['expert_bytes_on_flash'] / 1e6:.2f} MB an expert on flash, {report['slot_bytes'] / 1e6:.2f} MB "
             f"a slot in DRAM (scales at float32); the model as held {report['model_bytes'] / 1e9:.2f} GB, resident "
             f"part {report['resident_bytes'] / 1e9:.2f} GB. Uncached reads of one expert: {d['at_start']:.2f} GB/s "
             f"before the runs, {d['at_end']:.2f} after (the floor uses the lower). {report['tokens']} decode tokens "
             f"after {report['warmup']} of warm-up, {report['rounds']} alternating rounds, medians per token. Routing: "
             + ROUTING_TEXT[report["routing"]]
             + (f" The look-ahead guesses {report['lookahead_width']} experts a layer."
                if report["routing"] == "trace" and report.get("lookahead_width", report["top_k"]) != report["top_k"]
                else ""),
             "", "Rows: +lookahead reads the next layer's guessed experts during this layer; +overlap reads a "
             "layer's missing experts while its cached ones compute. Expert I/O ms: the time layers waited for "
             "expert reads (the rest of a token is compute); I/O hidden: the share of all expert read time, the "
             "layers' own and the look-ahead's, that no layer waited for.", "",
             "| budget | row | slots | ms/token | vs naive | expert I/O ms | compute ms | read MB/token | hit rate "
             "| look-ahead precision | I/O hidden | I/O floor ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for e in report["rows"]:
        vs = "-" if e["vs_naive"] is None else f"{e['vs_naive']:.2f}x"
        lines.append(f"| {e['budget']} | {e['row']} | {e['slots']} | {e['ms_per_token']:.0f} | {vs} "
                     f"| {e['io_ms']:.0f} | {e['compute_ms']:.0f} | {e['read_mb_per_token']:.1f} "
                     f"| {f(e['hit_rate'], '.3f')} | {f(e['precision'], '.2f')} | {f(e['hidden_share'], '.0%')} | {e['floor_ms']:.0f} |")
    if report["simulated_hit_rates"]:
        lines += ["", "Hit rates of every policy replayed on the routing of one run (its decode tokens, warm-up "
                  "included; one layer's experts a step), Belady's the offline optimum:", "",
                  "| budget | slots | steps | LRU | LFU | EdgeMoE | Belady | LRU, the slots split per layer |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for budget, h in report["simulated_hit_rates"].items():
            per = "-" if h["lru_per_layer"] is None else f"{h['lru_per_layer']:.3f}"
            lines.append(f"| {budget} | {h['slots']} | {h['steps']} | {h['lru']:.3f} | {h['lfu']:.3f} | "
                         f"{h['edgemoe']:.3f} | {h['belady']:.3f} | {per} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
