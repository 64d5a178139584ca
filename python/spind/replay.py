"""Replay a trace through SPIN's data plane with the spind torch ops, as an engine drives it.

    python3 -m spind.replay --trace DIR [--sparsity 0.5] [--dump FILE] [--json] ...

The flags, the --json summary and the --dump lines are those of `spinctl replay`, and so are the
numbers: both run the same data plane on the same inputs, and the dumps are equal byte for byte
(tests/python). Each step: begin_step; per layer select, the engine's indexer over the compacted
table (here: the trace's scores gathered into it), its top-K, remap, observe; then refresh.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy
import torch

import spind


class TraceError(Exception):
    pass


def load_trace(path):
    """meta.json and scores.npy ([steps, layers, rows, slots] float32, or float16 widened to
    float32 in memory as spinctl does), checked for what replay reads; TraceError says what is
    wrong."""
    meta_path = os.path.join(path, "meta.json")
    scores_path = os.path.join(path, "scores.npy")
    for p in (meta_path, scores_path):
        if not os.path.isfile(p):
            raise TraceError(f"{p}: not a regular file (a trace directory holds meta.json and "
                             "scores.npy; make one with spinctl gen-trace)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"{meta_path}: {e}") from None
    for key in ("layers", "block_size", "topk", "steps", "rows", "q_pos", "ctx_len"):
        if key not in meta:
            raise TraceError(f"{meta_path}: missing '{key}'")
    try:
        scores = numpy.load(scores_path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise TraceError(f"{scores_path}: {e}") from None
    want = (meta["steps"], meta["layers"], meta["rows"])
    if (scores.dtype not in (numpy.dtype("<f4"), numpy.dtype("<f2")) or scores.ndim != 4
            or tuple(scores.shape[:3]) != want):
        raise TraceError(f"{scores_path}: float32 or float16 [{want[0]}, {want[1]}, {want[2]}, "
                         f"slots] expected, found {scores.dtype} {list(scores.shape)}")
    if scores.dtype == numpy.float16:
        scores = scores.astype(numpy.float32)
    for key in ("q_pos", "ctx_len"):
        if len(meta[key]) != meta["steps"]:
            raise TraceError(f"{meta_path}: '{key}' has {len(meta[key])} entries for "
                             f"{meta['steps']} steps")
    accepted = meta.get("accepted") or []
    if accepted and len(accepted) != meta["steps"]:
        raise TraceError(f"{meta_path}: 'accepted' has {len(accepted)} entries for "
                         f"{meta['steps']} steps")
    n_max = scores.shape[3]
    for t in range(meta["steps"]):
        if not 0 < meta["ctx_len"][t] <= n_max - meta["rows"] + 1:
            raise TraceError(f"{meta_path}: ctx_len[{t}] = {meta['ctx_len'][t]} outside "
                             f"[1, {n_max - meta['rows'] + 1}]")
    return meta, scores


def topk_slots(scores, n, k):
    """The k highest of scores[:n] (non-finite excluded, ties to the lower id), ascending ids;
    the rule of tools/trace/score_math.cc's TopKSlots."""
    v = scores[:n]
    idx = torch.nonzero(torch.isfinite(v)).flatten()
    if idx.numel() > k:
        order = torch.sort(v[idx], descending=True, stable=True).indices
        idx = idx[order[:k]]
    return torch.sort(idx).values


def _mean(v):
    s = 0.0
    for x in v:
        s += x
    return s / len(v) if v else 0.0


def _percentile(v, p):
    if not v:
        return 0.0
    v = sorted(v)
    rank = math.ceil(p * len(v))
    return v[min(max(rank, 1), len(v)) - 1]


def _skipped(kept, total):
    return 0.0 if total == 0 else 1.0 - kept / total


# LayerStats columns of spind.ops.stats
(STEPS, DENSE, PROBE, KEPT, TOTAL, SKEPT, STOTAL, OBSERVED, BAD, PTOPK, PMISSED, XSTEPS, XTOPK,
 XEST) = range(14)
# The exploration estimate's fixed-point unit (kExploreEstUnit: 1/1024 slot)
EXPLORE_EST_UNIT = 1024


def replay(args, meta, scores, session, dump, progress):
    steps, layers, rows = meta["steps"], meta["layers"], meta["rows"]
    b, k = meta["block_size"], meta["topk"]
    max_blocks = session.union_ids.shape[1]
    stride = max_blocks * b
    accepted_meta = meta.get("accepted") or []
    session.reset_sequence(0, args.key)
    start = session.stats().tolist()
    start_epoch = session.counters()["epoch"]
    mode = session.policy()["budget_mode"]
    dev = session.device
    seq = torch.zeros(1, dtype=torch.int32, device=dev)
    ctx_t = torch.zeros(1, dtype=torch.int32, device=dev)
    q_t = torch.zeros(1, dtype=torch.int32, device=dev)
    acc_t = torch.zeros(1, dtype=torch.int32, device=dev)
    logits = torch.empty(rows, stride, dtype=torch.float32, device=dev)
    topk = torch.empty(rows, k, dtype=torch.int32, device=dev)
    offsets = torch.arange(b, dtype=torch.int64, device=dev)
    miss = [[] for _ in range(layers)]
    for t in range(steps):
        ctx = meta["ctx_len"][t]
        ctx_t[0] = ctx
        q_t[0] = meta["q_pos"][t]
        acc_t[0] = accepted_meta[t] if accepted_meta else rows
        try:
            session.begin_step(seq, ctx_t, q_t, rows)
        except RuntimeError as e:
            raise RuntimeError(f"step {t} layer -1: {e}") from None
        # a copy: the trace is read-only
        step_scores = torch.from_numpy(numpy.array(scores[t])).to(dev)
        for layer in range(layers):
            try:
                dense_before = int(session.stats()[layer, DENSE])
                session.select(layer)
                dense = int(session.stats()[layer, DENSE]) != dense_before
                count = int(session.union_count[0])
                ids = session.union_ids[0, :count].to(torch.int64)
                clen = session.compact_len[0, :rows].tolist()
                # The engine's indexer over the compacted table: row r sees the union's slots
                # below its own context; the rest of the row is padding.
                logits.fill_(-math.inf)
                slots = (ids[:, None] * b + offsets[None, :]).reshape(-1)
                for r in range(rows):
                    z = step_scores[layer, r]
                    valid = torch.nonzero(slots < ctx + r).flatten()
                    logits[r, valid] = z[slots[valid]]
                # Its own top-K over the compacted logits, remapped to logical slots.
                topk.fill_(-1)
                for r in range(rows):
                    sel = topk_slots(logits[r], clen[r], k)
                    topk[r, :sel.numel()] = sel.to(torch.int32)
                # Given as the engine's: a probe step counts it against the miss curve, and a
                # sparse step's exploration blocks measure the step's miss (docs/budgets.md).
                session.remap(topk, engine_topk=True)
                session.observe(layer, logits, acc_t)
            except RuntimeError as e:
                raise RuntimeError(f"step {t} layer {layer}: {e}") from None
            # Miss of row 0: dense top-K slots the sparse top-K lost.
            dense_topk = topk_slots(step_scores[layer, 0], ctx, k)
            lost = int((~torch.isin(dense_topk, topk[0].to(torch.int64))).sum())
            m = lost / dense_topk.numel() if dense_topk.numel() else 0.0
            if not dense:
                miss[layer].append(m)
            if dump is not None:
                blocks = ",".join(str(i) for i in ids.tolist())
                dump.write(f'{{"step":{t},"layer":{layer},"blocks":[{blocks}],'
                           f'"miss":{"%.6g" % m}}}\n')
        try:
            session.refresh()
        except RuntimeError as e:
            raise RuntimeError(f"step {t} layer -1: {e}") from None
        if progress:
            progress(t + 1, steps)
    now = session.stats().tolist()
    table = session.budgets().tolist()
    counters = session.counters()
    out = {"steps": steps, "layers": layers, "budget_mode": mode,
           "budget_recomputes": counters["budget_recomputes"],
           "epoch_advance": counters["epoch"] - start_epoch,
           "dense_steps": 0, "bad_scores": 0, "worst_layer_mean_miss": 0.0, "worst_layer": 0,
           "per_layer": []}
    everything = []
    kept = total = skept = stotal = 0
    for layer in range(layers):
        s, s0 = now[layer], start[layer]
        d = [s[i] - s0[i] for i in range(14)]
        ls = {"layer": layer, "mean_miss": _mean(miss[layer]),
              "p99_miss": _percentile(miss[layer], 0.99),
              "sparsity": _skipped(d[SKEPT], d[STOTAL]),
              "effective_sparsity": _skipped(d[KEPT], d[TOTAL]), "budget": table[layer],
              "probe_steps": d[PROBE], "bad_scores": d[BAD],
              "explore_miss": d[XEST] / EXPLORE_EST_UNIT / d[XTOPK] if d[XTOPK] else 0.0,
              "explore_steps": d[XSTEPS]}
        everything.extend(miss[layer])
        kept, total, skept, stotal = kept + d[KEPT], total + d[TOTAL], skept + d[SKEPT], \
            stotal + d[STOTAL]
        out["dense_steps"] += d[DENSE]
        out["bad_scores"] += d[BAD]
        if ls["mean_miss"] > out["worst_layer_mean_miss"]:
            out["worst_layer_mean_miss"] = ls["mean_miss"]
            out["worst_layer"] = layer
        out["per_layer"].append(ls)
    out["sparse_steps"] = len(everything)
    out["mean_miss"] = _mean(everything)
    out["p99_miss"] = _percentile(everything, 0.99)
    out["realized_sparsity"] = _skipped(skept, stotal)
    out["effective_sparsity"] = _skipped(kept, total)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python3 -m spind.replay",
        description="Replay a trace through the SPIN data plane with the spind torch ops and "
                    "report miss rate and sparsity (the flags and output of spinctl replay)")
    ap.add_argument("--trace", required=True, help="Trace directory (meta.json + scores.npy)")
    ap.add_argument("--sparsity", type=float, default=0.5,
                    help="Target block sparsity rho in [0, 1)")
    ap.add_argument("--exploration", type=float, default=0.05,
                    help="Share of kept blocks chosen at random, in [0, 1)")
    ap.add_argument("--alpha", type=float, default=0.3,
                    help="EMA decay (weight of history), in [0, 1)")
    ap.add_argument("--probe-period", type=int, default=0,
                    help="Every P-th step is a dense probe step (0: none)")
    ap.add_argument("--budget", choices=spind.BUDGET_MODES, default="uniform",
                    help="Budget mode (per-layer and miss-target need --probe-period)")
    ap.add_argument("--miss-target", type=float, default=0.0,
                    help="Instead of a sparsity: each layer at the highest sparsity whose mean "
                         "miss the probe curves predict at most this, in (0, 1); the "
                         "miss-target budget mode")
    ap.add_argument("--seed", type=int, default=1, help="Session seed of the exploration draws")
    ap.add_argument("--key", type=int, default=0, help="Sequence key of the exploration draws")
    ap.add_argument("--state", choices=["fp32", "bf16"], default="fp32", help="State dtype")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu",
                    help="Data plane: cpu (reference) or cuda")
    ap.add_argument("--target", default="",
                    help="spind address (unix:///run/spin/spind.sock): run through a session "
                         "in the daemon (fail-open attach) instead of a private data plane")
    ap.add_argument("--dump", help="Write JSONL, one line per (step, layer): selected blocks "
                                   "and row-0 miss")
    ap.add_argument("--json", action="store_true", help="Print the summary as one JSON object")
    ap.add_argument("--quiet", action="store_true", help="No progress on stderr")
    args = ap.parse_args(argv)

    def fail(msg):
        print(f"spind.replay: error: {msg}", file=sys.stderr)
        return 1

    if args.backend == "cuda" and not torch.cuda.is_available():
        return fail("--backend cuda: torch sees no CUDA device")
    if args.miss_target != 0:
        # As spinctl replay: --miss-target chooses the miss-target mode.
        if args.budget == "per-layer":
            return fail("--miss-target and --budget per-layer are two budget modes: give one")
        args.budget = "miss-target"
    if args.budget != "uniform" and args.probe_period == 0:
        flag = "--miss-target" if args.miss_target else f"--budget {args.budget}"
        return fail(f"{flag} needs --probe-period > 0 (the probe steps give the miss curves)")
    try:
        meta, scores = load_trace(args.trace)
    except TraceError as e:
        return fail(str(e))
    try:
        session = spind.Session(
            meta["layers"], scores.shape[3], block_size=meta["block_size"], topk=meta["topk"],
            max_rows=meta["rows"], state=args.state, seed=args.seed,
            target_sparsity=args.sparsity, exploration=args.exploration, alpha=args.alpha,
            probe_period=args.probe_period, budget_mode=args.budget,
            miss_target=args.miss_target, target=args.target,
            client_name="spind.replay", device="cuda" if args.backend == "cuda" else None)
    except RuntimeError as e:
        return fail(str(e))
    with session:
        if args.target:
            deadline = time.monotonic() + 10
            while not session.counters()["attached"]:
                if time.monotonic() > deadline:
                    return fail(f"spind at {args.target} did not attach a session in 10 s "
                                "(is it running? spinctl --target ... status)")
                time.sleep(0.05)
                session.refresh()
            session.refresh()
        dump = open(args.dump, "w", encoding="ascii") if args.dump else None
        last = [0.0]

        def progress(done, total):
            if args.quiet or time.monotonic() - last[0] < 1 and done != total:
                return
            last[0] = time.monotonic()
            print(f"\rstep {done}/{total}", end="\n" if done == total else "", file=sys.stderr)

        try:
            summary = replay(args, meta, scores, session, dump, progress)
        except RuntimeError as e:
            return fail(str(e))
        finally:
            if dump is not None:
                dump.close()
    if args.json:
        print(json.dumps(summary, sort_keys=True, separators=(",", ":")))
    else:
        print(f"steps {summary['steps']}, layers {summary['layers']}: mean miss "
              f"{summary['mean_miss']:.4f}, p99 miss {summary['p99_miss']:.4f}, realized "
              f"sparsity {summary['realized_sparsity']:.4f}, effective sparsity "
              f"{summary['effective_sparsity']:.4f} ({summary['budget_mode']} budgets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
