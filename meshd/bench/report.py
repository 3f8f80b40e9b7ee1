"""The benchmark report: one JSON object with the figures of docs/benchmarks.md, and its summary table.

Keys that are peer counts or concurrency levels are strings in JSON ("1", "2", ...). Seams are the
hidden-state hops between peers (``seam_ms``, measured by the receiving peer); the entry's token
bundles into the head peer are reported apart (``entry_*``), as they carry token ids, not hidden
states. Time per decode step is attributed, per hop and using the means over every decode step of
the single-session runs, to deserializing the incoming bundle, queueing for the compute thread,
compute (the forward), serializing the outgoing bundle, and the network between the sender's
serializing and the receiver's deserializing; what is left is the tail's token back to the entry,
the entry and the API (``other``). ``seam_transfers_per_token`` counts the bundles that crossed a
seam per decode step: one traversal of the route is one per hop.

Runs on shaped links (``meshctl bench --link``) go under ``links``, by shape label: the shape, what
its shaper delivered on loopback (``shaper``), and ``meshes``: a list of variants run on that link,
each with the ``setup`` it ran with and the same mesh figures as the top level. The top level stays
the plain loopback run either way.

At ``--dtype int8`` the plain loopback meshes run again in float32, each against a float32 process
(``float32``: the same figures), and ``int8_speedup`` sets int8's decode tok/s over float32's, of one
process and of each mesh; ``quality`` holds the held-out perplexity of the ``trained`` model in both.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshd.bench.baseline import BaselineResult

if TYPE_CHECKING:
    from meshd.bench.runner import MeshResult
    from meshd.links.profiles import LinkShape


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


PARTS = ("deserialize_ms", "queue_ms", "compute_ms", "serialize_ms")


def _window(stats: dict, name: str) -> dict:
    window = stats.get(name) or {"count": 0}
    return {q: _r(window.get(q)) for q in ("p50", "p95", "mean")} | {"count": window["count"]}


def _hop_profile(index: int, start_end: tuple[int, int], peer_id: str, stats: dict) -> dict:
    return {
        "hop": index, "peer_id": peer_id, "layers": list(start_end),
        **{part: _window(stats, part) for part in PARTS},
        "seam_in": "entry" if index == 0 else "hidden",
        "seam_in_ms": _window(stats, "entry_seam_ms" if index == 0 else "seam_ms"),
        "bundle_bytes_p50": stats["decode_bundle_bytes"].get("p50"),
        # prefill chunks of the single-session runs: per chunk, and in all per run
        "prefill": {part: _window(stats, f"prefill_{part}") for part in ("seam_ms", "queue_ms", "compute_ms")},
    }


def _attribute(hops: list[dict]) -> None:
    """Give each hop ``network_ms``: the mean time its incoming bundle spent between the sender's
    serializing and this hop's deserializing (sockets, HTTP/2 and both event loops). The entry's own
    encoding of a token id is not measured apart and counts as network."""
    for i, hop in enumerate(hops):
        seam = hop["seam_in_ms"]["mean"]
        sent = hops[i - 1]["serialize_ms"]["mean"] if i > 0 else 0.0
        parsed = hop["deserialize_ms"]["mean"]
        hop["network_ms"] = None if None in (seam, sent, parsed) else _r(max(0.0, seam - sent - parsed))


def _mesh_figures(mesh: MeshResult) -> dict[str, Any]:
    tok_s = statistics.median(r.decode_tok_s for r in mesh.runs)
    baseline_tok_s = statistics.median(mesh.baseline_tok_s)
    hops = [_hop_profile(i, mesh.ranges[i], mesh.peer_ids[i], s) for i, s in enumerate(mesh.hop_stats)]
    _attribute(hops)
    hidden = [s["seam_ms"] for s in mesh.hop_stats[1:] if s["seam_ms"]["count"]]
    hidden_bytes = [s["decode_bundle_bytes"]["p50"] for s in mesh.hop_stats[1:] if s["decode_bundle_bytes"]["count"]]
    entry = mesh.hop_stats[0]["entry_seam_ms"]
    step_ms = _mean([1000 / r.decode_tok_s for r in mesh.runs if r.decode_tok_s])
    split = {part: _r(sum(h[part]["mean"] or 0.0 for h in hops)) for part in PARTS}
    split["network_ms"] = _r(sum(h["network_ms"] or 0.0 for h in hops))
    accounted = sum(v or 0.0 for v in split.values())
    seams_ms = sum(h["seam_in_ms"]["mean"] or 0.0 for h in hops)
    ttft_ms = statistics.median(r.ttft_ms for r in mesh.runs)
    ttft_mean_ms = statistics.fmean(r.ttft_ms for r in mesh.runs)
    per_run = {part: _r(sum((h["prefill"][part]["mean"] or 0.0) * h["prefill"][part]["count"] for h in hops)
                        / len(mesh.runs)) for part in ("seam_ms", "queue_ms", "compute_ms")}
    steps = hops[-1]["compute_ms"]["count"]
    transfers = sum(h["seam_in_ms"]["count"] for h in hops)
    return {
        "tok_s": tok_s, "ratio": tok_s / baseline_tok_s, "baseline_tok_s": baseline_tok_s,
        "ttft_ms": ttft_ms,
        # a first token's prefill, summed over hops and chunks, split out of the runs' mean TTFT (the
        # parts are means too): exact for a prompt of one chunk; with several, chunks on different hops
        # overlap in time and a chunk's seam includes its wait behind the previous one, so the parts
        # can add up to more than the TTFT
        "ttft_split": {"ttft_mean_ms": _r(ttft_mean_ms), "prefill_compute_ms": per_run["compute_ms"],
                       "prefill_queue_ms": per_run["queue_ms"], "prefill_seams_ms": per_run["seam_ms"],
                       "other_ms": _r(ttft_mean_ms - sum(v or 0.0 for v in per_run.values()))},
        "seam": {
            "p50": _r(_mean([s["p50"] for s in hidden])), "p95": _r(_mean([s["p95"] for s in hidden])),
            "per_seam_p50": [_r(s["p50"]) for s in hidden], "per_seam_p95": [_r(s["p95"]) for s in hidden],
            "entry_p50": _r(entry.get("p50")), "entry_p95": _r(entry.get("p95")),
        },
        "bytes": {"hidden": _mean(hidden_bytes), "entry": mesh.hop_stats[0]["decode_bundle_bytes"].get("p50")},
        # bundles that crossed a seam per decode step: the entry's into the head, then one per later hop
        "seam_transfers_per_token": _r(transfers / steps) if steps else None,
        # reply tokens per decode step (a traversal of the route): 1 without speculation
        "tokens_per_step": _r(sum(max(0, r.completion_tokens - 1) for r in mesh.runs) / steps) if steps else None,
        "profile": {
            "step_ms": _r(step_ms), "compute_ms": split["compute_ms"], "seams_ms": _r(seams_ms),
            "other_ms": _r(step_ms - (split["compute_ms"] or 0.0) - seams_ms - (split["queue_ms"] or 0.0))
            if step_ms else None,
            "split": split | {"other_ms": _r(step_ms - accounted) if step_ms else None},
            "hops": hops,
        },
        "runs": {"tok_s": [_r(r.decode_tok_s) for r in mesh.runs], "ttft_ms": [_r(r.ttft_ms) for r in mesh.runs],
                 "chunks": [r.chunks for r in mesh.runs]},
        # the entry's guesses over the single-session runs, by draft source (the entry is the head)
        "speculation": mesh.hop_stats[0].get("speculation"),
        "route": _route_summary(mesh.route),
    }


def _route_summary(route: dict) -> dict[str, Any]:
    """The entry's planned route: its peers and estimated ms per token, and what each crossing costs."""
    if not route.get("hops"):
        return {}
    crossings = [h.get("crossing") or {} for h in route["hops"]] + [route.get("back") or {}]
    return {"peers": [h["peer_id"][:12] for h in route["hops"]], "cost_ms": route.get("cost_ms"),
            "compute_ms": [h.get("compute_ms") for h in route["hops"]],
            "crossing_ms": [_r((c.get("latency_ms") or 0.0) + (c.get("transfer_ms") or 0.0)) for c in crossings],
            "rtt_ms": [c.get("rtt_ms") for c in crossings]}


def build_report(meta: dict, baseline: BaselineResult, meshes: list) -> dict:
    figures = {str(m.peers): _mesh_figures(m) for m in meshes}
    largest = max(meshes, key=lambda m: m.peers)
    top = figures[str(largest.peers)]
    aggregate = dict(sorted(largest.aggregate_tok_s.items()))
    gain_at = 4 if 4 in aggregate else min((c for c in aggregate if c > 1), default=None)
    gain = aggregate[gain_at] / aggregate[1] if gain_at is not None and 1 in aggregate else None
    ceiling: dict[int, float] = getattr(largest, "ceiling_tok_s", {})
    return {
        **meta,
        "baseline_tok_s": _r(baseline.decode_tok_s),
        "mesh_tok_s": {k: _r(f["tok_s"]) for k, f in figures.items()},
        # each mesh against the baseline runs just before and after it (its own entry here)
        "ratio": {k: _r(f["ratio"], 4) for k, f in figures.items()},
        "baseline_tok_s_by_peers": {k: _r(f["baseline_tok_s"]) for k, f in figures.items()},
        "ttft_ms": {"baseline": _r(baseline.ttft_ms)} | {k: _r(f["ttft_ms"]) for k, f in figures.items()},
        "ttft_split": {k: f["ttft_split"] for k, f in figures.items()},
        "seam_ms_p50": top["seam"]["p50"],
        "seam_ms_p95": top["seam"]["p95"],
        "seam_ms": {k: f["seam"] for k, f in figures.items()},
        "bytes_per_token_per_seam": top["bytes"]["hidden"],
        "bytes_per_token": {k: f["bytes"] for k, f in figures.items()},
        "seam_transfers_per_token": {k: f["seam_transfers_per_token"] for k, f in figures.items()},
        "tokens_per_step": {k: f["tokens_per_step"] for k, f in figures.items()},
        "aggregate_tok_s": {str(c): _r(v) for c, v in aggregate.items()},
        "aggregate_peers": largest.peers,
        "batching_gain": _r(gain, 4),
        "batching_gain_concurrency": gain_at,
        "ceiling_tok_s": {str(c): _r(v) for c, v in sorted(ceiling.items())},
        "ceiling_runs_tok_s": {str(c): [_r(v) for v in runs]
                               for c, runs in sorted(getattr(largest, "ceiling_runs_tok_s", {}).items())},
        "ceiling_ratio": {str(c): _r(aggregate[c] / v, 4) for c, v in sorted(ceiling.items())
                          if c in aggregate and v > 0},
        "batches": largest.batches,
        "compute_share": {str(c): v for c, v in sorted(getattr(largest, "compute_share", {}).items())},
        "cpu_share": {str(c): v for c, v in sorted(getattr(largest, "cpu_share", {}).items())},
        "peer_rss_mb": {str(m.peers): [_r(v, 1) for v in m.rss_mb] for m in meshes},
        "model_size_mb": _r(baseline.model_bytes / 2**20, 1),
        "baseline_rss_mb": _r(baseline.rss_mb, 1),
        "tokens_identical": all(all(m.identical) for m in meshes),
        "tokens_identical_by_peers": {str(m.peers): all(m.identical) for m in meshes},
        # every split answers what the mesh with the fewest peers answered: the split changes nothing,
        # whatever the dtype (against transformers only float32 is expected to match token for token)
        "split_identical": all(m.texts == meshes[0].texts for m in meshes),
        "speculation": {k: f["speculation"] for k, f in figures.items()},
        "route": {k: f["route"] for k, f in figures.items()},
        "profile": {"baseline_step_ms": _r(_mean([1000 / v for v in baseline.runs_tok_s if v]))}
        | {k: f["profile"] for k, f in figures.items()},
        "runs_detail": {"baseline": {"tok_s": [_r(v) for v in baseline.runs_tok_s],
                                     "ttft_ms": [_r(v) for v in baseline.runs_ttft_ms]}}
        | {k: f["runs"] for k, f in figures.items()},
    }


def link_report(shape: LinkShape, shaper: dict, baseline: BaselineResult, variants: list[tuple[dict, list]]) -> dict:
    """One link shape: what it was set to, what its shaper delivered, and each variant of meshes run
    over it, as ``(setup, meshes)`` with ``setup`` saying how that variant ran (``{"link": NAME, ...}``)."""
    return {"shape": shape.as_json(), "shaper": shaper,
            "meshes": [{"setup": setup, **build_report({}, baseline, meshes)} for setup, meshes in variants]}


def write_report(path: Path, report: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _idle_policy(wake: dict) -> str:
    """The idle CPUs' handling after the wake-up figures, where the report has it (older ones do not)."""
    policy = wake.get("idle_policy") or {}
    if not policy.get("driver"):
        return ""
    poll = policy.get("guest_halt_poll_ns") if policy.get("governor") == "haltpoll" else None  # else unused
    polls = ("" if poll is None else ", an idle vCPU halts at once" if poll == 0
             else f", an idle vCPU polls up to {poll / 1000:g} us before it halts")
    return f" (cpuidle {policy['driver']}/{policy.get('governor') or '?'}{polls}{_idle_residency(wake)})"


def _idle_residency(wake: dict) -> str:
    """How the idle CPUs spent their idle time while the benchmark ran, where the report has it."""
    by_state = wake.get("idle_s_by_state") or {}
    idle = sum(by_state.values())
    if idle <= 0:
        return ""
    return f"; while it ran, idle CPUs polled {by_state.get('POLL', 0.0) / idle:.0%} of their {idle:.0f} s idle"


def _cpus(report: dict) -> str:
    """How many CPUs, and which, where the report says (older ones do not)."""
    which = [str(report["cpu_model"])] if report.get("cpu_model") else []
    if report.get("cpu_features"):
        which.append(" ".join(report["cpu_features"]))
    return f"{report['cpu_count']} CPUs" + (f" ({', '.join(which)})" if which else "")


def format_summary(report: dict) -> str:
    lines = [
        f"model {report['model']} ({report['model_size_mb']:.0f} MB {report.get('dtype', 'float32')}), "
        f"prompt {report['prompt_tokens']} + "
        f"{report['new_tokens']} new tokens, {report['torch_threads']} torch threads, {_cpus(report)}",
        "",
        f"{'':10}{'tok/s':>9}{'ratio':>8}{'TTFT ms':>10}{'seam p50/p95 ms':>18}{'B/tok/seam':>12}"
        f"{'step ms = compute + queue + seams + other':>46}  {'RSS MB':<20}identical",
    ]
    base_step = report["profile"]["baseline_step_ms"]
    lines.append(f"{'baseline':10}{report['baseline_tok_s']:>9.2f}{1:>8.3f}{report['ttft_ms']['baseline']:>10.1f}"
                 f"{'-':>18}{'-':>12}{_fmt(base_step):>46}  {report['baseline_rss_mb']:<20.0f}-")
    for k, tok_s in report["mesh_tok_s"].items():
        seam = report["seam_ms"][k]
        prof = report["profile"][k]
        seams = f"{_fmt(seam['p50'], '.3f')}/{_fmt(seam['p95'], '.3f')}"
        split = (f"{_fmt(prof['step_ms'])} = {_fmt(prof['compute_ms'])} + {_fmt(prof['split']['queue_ms'])} + "
                 f"{_fmt(prof['seams_ms'])} + {_fmt(prof['other_ms'])}")
        rss = "/".join(f"{v:.0f}" for v in report["peer_rss_mb"][k])
        label = f"{k} peer" + ("s" if k != "1" else "")
        lines.append(f"{label:10}{tok_s:>9.2f}{report['ratio'][k]:>8.3f}{report['ttft_ms'][k]:>10.1f}{seams:>18}"
                     f"{_fmt(report['bytes_per_token'][k]['hidden'], '.0f'):>12}{split:>46}  {rss:<20}"
                     f"{'yes' if report['tokens_identical_by_peers'][k] else 'NO'}")
    brackets = ", ".join(f"{k} peer{'s' if k != '1' else ''} {v:.2f}"
                         for k, v in report["baseline_tok_s_by_peers"].items())
    lines.append(f"each ratio is against the baseline runs just before and after that mesh (tok/s): {brackets}")
    default = report.get("transformers_default")
    if default:
        over = ", ".join(f"{k} peer{'s' if k != '1' else ''} {_fmt(v)}x"
                         for k, v in default["mesh_over_default"].items())
        ceiling = "".join(f", batch {c} {v:.2f}" for c, v in default["ceiling_tok_s"].items())
        lines.append(f"the baseline computes its linears as the peers do ({report.get('numerics')}); with torch's own "
                     f"kernels transformers ran {default['decode_tok_s']:.2f} tok/s (TTFT {default['ttft_ms']:.1f} ms"
                     f"{ceiling}) before the meshes: baseline {_fmt(default['baseline_over_default'])}x, {over} of it")
    wake = report.get("wakeup")
    if wake:
        thread, process = wake["thread_handoff_us"], wake["process_round_trip_us"]
        lines.append(f"wake-ups on this machine, p50 us hot / after {wake['idle_ms']:.0f} ms idle: thread hand-off "
                     f"{thread['hot']['p50']:.0f} / {thread['idle']['p50']:.0f}, process round trip "
                     f"{process['hot']['p50']:.0f} / {process['idle']['p50']:.0f}{_idle_policy(wake)}")
    if report["aggregate_tok_s"]:
        levels = ", ".join(f"c={c}: {v:.2f}" for c, v in report["aggregate_tok_s"].items())
        gain = report["batching_gain"]
        lines += ["", f"aggregate tok/s with {report['aggregate_peers']} peers: {levels}"
                  + (f"; batching gain (c={report['batching_gain_concurrency']} / c=1) {gain:.2f}x" if gain else "")]
        if report.get("ceiling_tok_s"):
            runs = report.get("ceiling_runs_tok_s", {})
            lines.append("one process, batched generate() at the same batch, mean of before and after the mesh: "
                         + ", ".join(f"c={c}: {v:.2f} tok/s"
                                     + (f" ({' and '.join(f'{r:.2f}' for r in runs[c])})" if c in runs else "")
                                     + f" (mesh {report['ceiling_ratio'].get(c, 0):.2f}x)"
                                     for c, v in report["ceiling_tok_s"].items()))
    if report.get("compute_share"):
        lines.append("hops computing, share of the wall time (summed over hops; decode + prefill): " + ", ".join(
            f"c={c}: {v['summed']:.2f} ({v['decode']:.2f} + {v['prefill']:.2f})"
            for c, v in report["compute_share"].items()))
    if report.get("cpu_share"):
        lines.append("CPUs busy during each load, the client + each hop (the machine in all): " + ", ".join(
            f"c={c}: {v['client']:.2f} + {' + '.join(f'{p:.2f}' for p in v['peers'])} ({v['machine']:.2f} of "
            f"{v['cpus']})" for c, v in report["cpu_share"].items()))
        loops = {c: v["loops"] for c, v in report["cpu_share"].items()
                 if v.get("loops") and None not in v["loops"] and report["aggregate_tok_s"].get(c)}
        if loops:
            lines.append("of that, the hops' event loops (transport, sessions, API), and their CPU ms per token: "
                         + ", ".join(f"c={c}: {' + '.join(f'{p:.3f}' for p in v)} "
                                     f"({1000 * sum(v) / report['aggregate_tok_s'][c]:.2f} ms)"
                                     for c, v in loops.items()))
    for i, batches in enumerate(report.get("batches") or []):
        sizes = ", ".join(f"{size}: {count}" for size, count in batches["batch_sizes"].items())
        lines.append(f"  hop {i} decode batches over the concurrent runs (size: count) {sizes}; "
                     f"{batches['held_batches']} held for sessions due, {batches['held_s']:.2f} s in all")
        if batches.get("prefill_runs"):
            runs = ", ".join(f"{chunks}: {count}" for chunks, count in batches["prefill_runs"].items())
            lines.append(f"  hop {i} prefill computes (prompts' chunks computed together: count) {runs}; "
                         f"{batches.get('prefill_restarts', 0)} started again to take in prompts queued behind them")
    k = max(report["mesh_tok_s"], key=int)
    hops = report["profile"][k]["hops"]
    lines += ["", f"per hop, {k} peers (decode step means, ms; network = seam in - sender's serialize "
              "- own deserialize):"]
    for hop in hops:
        lines.append(f"  hop {hop['hop']} layers [{hop['layers'][0]},{hop['layers'][1]}): "
                     f"{hop['seam_in']} seam in {_fmt(hop['seam_in_ms']['mean'], '.3f')} "
                     f"(network {_fmt(hop['network_ms'], '.3f')}), deserialize "
                     f"{_fmt(hop['deserialize_ms']['mean'], '.3f')}, queue {_fmt(hop['queue_ms']['mean'], '.3f')}, "
                     f"compute {_fmt(hop['compute_ms']['mean'], '.3f')}, serialize "
                     f"{_fmt(hop['serialize_ms']['mean'], '.3f')}; {_fmt(hop['bundle_bytes_p50'], '.0f')} B/bundle")
    split = report["ttft_split"][k]
    lines.append(f"first token, {k} peers: TTFT {_fmt(split['ttft_mean_ms'], '.1f')} ms (mean of the runs); "
                 "prefill summed over hops: "
                 f"compute {_fmt(split['prefill_compute_ms'])}, queue {_fmt(split['prefill_queue_ms'])}, seams "
                 f"{_fmt(split['prefill_seams_ms'])}; other {_fmt(split['other_ms'])}")
    transfers = report["seam_transfers_per_token"][k]
    lines.append(f"seam transfers per decode token: {_fmt(transfers)} for {len(hops)} hops")
    lines.append(f"tokens identical to the baseline: {'yes' if report['tokens_identical'] else 'NO'}; "
                 f"every split identical to the {min(report['mesh_tok_s'], key=int)}-peer mesh: "
                 f"{'yes' if report['split_identical'] else 'NO'} (dtype {report.get('dtype')}, "
                 f"numerics {report.get('numerics')})")
    if report.get("links"):
        lines += ["", *_link_lines(report)]
    if report.get("speculative_speedup"):
        lines += ["", "speculative decoding against none, decode tok/s in this run (replies identical):"]
        for place, modes in report["speculative_speedup"].items():
            for mode, by_peers in modes.items():
                cells = ", ".join(f"{k} peer{'s' if k != '1' else ''} {_fmt(v, '.2f')}x" for k, v in by_peers.items())
                lines.append(f"  {place}, speculative {mode}: {cells}")
    if report.get("int8_speedup"):
        lines += ["", *_int8_lines(report)]
    return "\n".join(lines)


def _int8_lines(report: dict) -> list[str]:
    """int8 against float32 in the same run: decode speed of one process and of each mesh, and quality."""
    fp32, speedup, quality = report["float32"], report["int8_speedup"], report["quality"]
    meshes = ", ".join(f"{k} peer{'s' if k != '1' else ''} {_fmt(v, '.2f')}x ({_fmt(report['mesh_tok_s'][k])} vs "
                       f"{_fmt(fp32['mesh_tok_s'].get(k))} tok/s)" for k, v in speedup["mesh"].items())
    ppl = quality["perplexity"]
    return [f"int8 against float32, decode tok/s in this run: one process {_fmt(speedup['one_process'], '.2f')}x "
            f"({_fmt(report['baseline_tok_s'])} vs {_fmt(fp32['baseline_tok_s'])}); {meshes}",
            f"  float32 meshes: tokens identical to the float32 baseline: "
            f"{'yes' if fp32['tokens_identical'] else 'NO'}, every split identical: "
            f"{'yes' if fp32['split_identical'] else 'NO'} (numerics {fp32.get('numerics')})",
            f"  held-out perplexity of {quality['model']}: float32 {ppl['float32']:.3f}, int8 {ppl['int8']:.3f} "
            f"({quality['perplexity_increase'] * 100:+.2f} %)"]


def _link_lines(report: dict) -> list[str]:
    """Per link shape: set against delivered, then each variant's tok/s, ratio and seam per peer count."""
    lines = ["on shaped links (every peer's outgoing peer traffic; shaper measured on loopback first):"]
    for label, link in report["links"].items():
        got = link["shaper"]
        lines.append(f"  {label} ({link['shape']['spec']}): one-way delay p50/p95 "
                     f"{_fmt(got['measured_delay_ms_p50'], '.3f')}/{_fmt(got['measured_delay_ms_p95'], '.3f')} ms "
                     f"(set {got['set_delay_ms']:g}), jitter {_fmt(got['measured_jitter_ms'], '.3f')} ms "
                     f"(set ±{got['set_jitter_ms']:g}), rate {_fmt(got['measured_rate_mbit'], '.1f')} Mbit/s "
                     f"(set {got['set_rate_mbit']:g})")
        for variant in link["meshes"]:
            setup = ", ".join(f"{key} {value}" for key, value in variant["setup"].items() if key != "link")
            cells = "; ".join(
                f"{k} peer{'s' if k != '1' else ''} {tok_s:.2f} tok/s (ratio {variant['ratio'][k]:.3f}, TTFT "
                f"{variant['ttft_ms'][k]:.1f} ms, seam p50 {_fmt(variant['seam_ms'][k]['p50'], '.3f')} ms)"
                for k, tok_s in variant["mesh_tok_s"].items())
            cells += "".join(f"; {k}: {tps:.2f} tokens/step" for k, tps in variant.get("tokens_per_step", {}).items()
                             if tps is not None and variant["setup"].get("speculative", "off") != "off")
            same = "identical" if variant["tokens_identical"] else "tokens DIFFER from the baseline"
            lines.append(f"    {setup + ': ' if setup else ''}{cells}; {same}")
    return lines


def format_gguf_summary(report: dict) -> str:
    """The GGUF benchmark: a header, then each engine's table against llama.cpp in one process."""
    lines = [f"GGUF {report['model']} ({report['quantization']}, {report['file_bytes'] / 2**20:.0f} MiB file); "
             f"baseline: {report['baseline_engine']}"]
    for path, sub in report["paths"].items():
        lines += ["", f"== {path} engine on every peer (numerics {sub['numerics']}) ==", format_summary(sub)]
    lines += ["", f"top-1 agreement, torch path vs llama.cpp, teacher-forced over {report['top1_agreement_steps']} "
              f"greedy tokens: {report['top1_agreement']:.3f}",
              f"every split identical to the fewest-peer mesh, each engine: "
              f"{'yes' if report['split_identical'] else 'NO'}"]
    return "\n".join(lines)



def _server_name(key: str) -> str:
    names = {"one_process": "one process", "one_process_continuous": "one, continuous"}
    return names.get(key) or f"{key} peer" + ("s" if key != "1" else "")


def _p3(window: dict, digits: str = ".0f") -> str:
    return "/".join(_fmt(window.get(q), digits) for q in ("p50", "p95", "p99"))


def _mean_batch(batches: list[dict]) -> float | None:
    """The mean decode batch over a load's hops (or the one process's batches)."""
    return _mean([b["mean_batch"] for b in batches if b.get("mean_batch") is not None])


# the one-process servers each mesh's ratios are taken against: the key prefix of the ratios, and in words
_AGAINST = (("", "the one process's"), ("continuous_", "the continuous one process's"))


def format_serve_summary(report: dict) -> str:
    """The serving benchmark: every load on every server, then the ratios within the run."""
    lines = [
        f"serving {report['model']} ({report['dtype']}), {report['requests_per_load']} requests per load: prompts "
        f"{min(report['prompt_tokens_choices'])}..{max(report['prompt_tokens_choices'])} tokens, outputs "
        f"{min(report['new_tokens_choices'])}..{max(report['new_tokens_choices'])}, seed {report['seed']}; "
        f"{report['torch_threads']} torch threads, {_cpus(report)}, load {report['load_avg_1m'][0]} -> "
        f"{report['load_avg_1m'][1]}",
        "",
        f"{'load':16}{'server':16}{'tok/s':>9}{'req/s':>8}{'TTFT p50/p95/p99 ms':>22}{'ITL p50/p95/p99 ms':>21}"
        f"{'latency p50/p95/p99 ms':>25}{'batch':>7}  same",
    ]
    servers = report["servers"]
    for kind in ("closed", "poisson"):
        for key in servers["one_process"][kind]:
            label = f"{key} clients" if kind == "closed" else f"Poisson {key}/s"
            for name, server in servers.items():
                got = server[kind].get(key)
                if got is None:
                    continue
                lines.append(f"{label:16}{_server_name(name):16}{_fmt(got['tok_s']):>9}{_fmt(got['req_s'], '.3f'):>8}"
                             f"{_p3(got['ttft_ms']):>22}{_p3(got['itl_ms'], '.1f'):>21}{_p3(got['latency_ms']):>25}"
                             f"{_fmt(_mean_batch(got['batches'])):>7}  {got['replies_identical']}/{got['requests']}")
                label = ""
    lines.append("one process: static batches (generate()); one, continuous: the whole model as one shard, batched "
                 "step by step")
    lines.append("batch: mean decode batch (over the hops for a mesh); same: replies equal to the first server's")
    for prefix, against in _AGAINST:
        for level, by_peers in report.get(f"{prefix}closed_loop_ratio", {}).items():
            cells = ", ".join(f"{_server_name(k)} {_fmt(v, '.3f')}x" for k, v in by_peers.items())
            lines.append(f"closed loop, {level} clients: mesh tok/s over {against}: {cells}")
    sustained = report["sustained_rate"]
    cells = ", ".join(f"{_server_name(k)} {_fmt(v, 'g')}/s" for k, v in sustained.items())
    lines.append(f"sustained Poisson rate (p95 TTFT under {report['ttft_bound_s']:g} s up to it): {cells}")
    for prefix, against in _AGAINST:
        ratio = report.get(f"{prefix}sustained_ratio")
        if ratio is not None:
            cells = ", ".join(f"{_server_name(k)} {_fmt(v, '.3f')}x" for k, v in ratio.items())
            lines.append(f"sustained rate over {against}: {cells}")
    if report.get("share_rate") is not None:
        cells = ", ".join(f"{_server_name(k)} {'yes' if v else 'no'}" for k, v in report["sustains_share"].items())
        lines.append(f"sustains {report['share']:g} of the continuous one process's sustained rate "
                     f"({report['share_rate']:g}/s, tested as a rate of its own): {cells}")
    lines.append(f"every request got exactly its tokens: {'yes' if report['tokens_exact'] else 'NO'}")
    return "\n".join(lines)
