"""``meshctl bench --prefill-workers``: a long prompt arriving while its route decodes another session,
prefilled on the route itself and on idle replicas of the route's ranges; what each does to the
prompt's first token and to the other session's steps, with the replies compared.

One mesh: k peers holding the model's layers (the route), k more holding the same ranges as
prefill workers only (``--prefill-only``: no route decodes through them), and two entries without
layers, one with prefill workers, one without (``--prefill-workers 0``). With two CPUs or more the
route's peers run on one half of them and the replicas on the other, each half with its own CPU turn
(:mod:`meshd.runtime.cpu_turn`), as two machines would. In each round
an entry streams a long reply (the busy session) and, a moment later, sends the long prompt; the
busy session's token times show how its steps fared while the prompt was prefilled, and the
prompt's time to first token how long it took. The prompt's reply must be the same through both
entries and in one process running transformers ``generate()``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.bench.prefix_reuse import stream_chat
from meshd.bench.runner import (
    COVER_TIMEOUT_S,
    PEER_START_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    BenchError,
    Say,
    machine_meta,
    quiet_transformers,
    splittable_model,
    wait_for_speed_checks,
    written_report,
)
from meshd.bench.workload import build_prompt
from meshd.cli.demo import even_ranges
from meshd.daemon.local_mesh import LocalMesh, LocalPeer

BUSY = [{"role": "user", "content": "Describe the harbor town, its bridges and its markets, at length."}]
BASELINE_WINDOW_S = 2.0  # the busy session runs this long alone (or a quarter of its reply) before the prompt
ROUTE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkersBenchConfig:
    model: str = "bench"
    peers: int = 3
    prompt_tokens: int = 1536
    busy_tokens: int = 256    # the busy session's reply: long enough to run through the prompt's prefill
    new_tokens: int = 16
    repeats: int = 2
    dtype: str = "auto"
    pin: bool = True
    workdir: Path | None = None


class BusySession(threading.Thread):
    """A streamed reply of exactly ``tokens`` tokens, with the arrival time of each."""

    def __init__(self, client: Any, model: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.tokens = client, model, tokens
        self.times: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self.client.chat.completions.create(
                    model=self.model, messages=BUSY, max_tokens=self.tokens, temperature=0, stream=True,
                    logprobs=True, extra_body={"ignore_eos": True}):
                entries = chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs else None
                now = time.perf_counter()
                self.times += [now] * len(entries or [])
        except BaseException as exc:
            self.error = exc


def cpu_halves(pin: bool) -> tuple[set[int], set[int]] | None:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def busy_figures(times: list[float], sent: float, first: float) -> dict[str, Any]:
    """The busy session's steps before the prompt was sent and while it was prefilled (until its first token)."""
    before = [t for t in times if t < sent]
    during = [t for t in times if sent <= t <= first]
    gaps = [b - a for a, b in itertools.pairwise(times) if sent <= b <= first]

    def rate(points: list[float]) -> float | None:
        return (len(points) - 1) / (points[-1] - points[0]) if len(points) >= 2 and points[-1] > points[0] else None

    before_rate = rate(before[2:])  # its first tokens include its own prefill
    during_rate = len(during) / (first - sent) if first > sent else None
    return {
        "tok_s_before": round(before_rate, 2) if before_rate else None,
        "tok_s_during_prefill": round(during_rate, 2) if during_rate is not None else None,
        "rate_kept": round(during_rate / before_rate, 3) if before_rate and during_rate is not None else None,
        "tokens_during_prefill": len(during),
        "longest_gap_ms": round(max(gaps) * 1000, 1) if gaps else None,
        "median_gap_ms": round(statistics.median(gaps) * 1000, 1) if gaps else None,
        "ran_throughout": bool(times) and times[-1] >= first,
    }


def run_workers_bench(cfg: WorkersBenchConfig, say: Say) -> dict:
    import torch
    from openai import OpenAI

    from meshd.bench.baseline import Baseline
    from meshd.bench.prefix_reuse import _dtype
    from meshd.models.text import TextCodec

    quiet_transformers()
    if cfg.prompt_tokens < 128 or cfg.busy_tokens < 16 or cfg.new_tokens < 1 or cfg.repeats < 1:
        raise BenchError("the prefill-workers benchmark needs a prompt of 128 tokens or more, a busy reply of 16 "
                         "or more, a new token and a round")
    model_dir, n_layers = splittable_model(cfg.model, (cfg.peers,), say)
    model_id = model_dir.name
    codec = TextCodec.load(model_dir)
    halves = cpu_halves(cfg.pin)
    threads = len(halves[0]) if halves else torch.get_num_threads()
    load_start = os.getloadavg()[0]
    ranges = even_ranges(n_layers, cfg.peers)
    flags = ["--dtype", cfg.dtype, "--torch-threads", str(threads)]
    min_tokens = min(1024, cfg.prompt_tokens // 2)
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="meshd-bench-workers-"))
    rounds: list[dict[str, Any]] = []
    prompts: list[list[dict]] = []
    with LocalMesh(workdir, log_level="warning", env={"OMP_NUM_THREADS": str(threads)}) as mesh:
        say(f"route of {cfg.peers} peers: layers {', '.join(f'[{s},{e})' for s, e in ranges)}; a prefill-only "
            "replica of each range" + (f"; route on CPUs {sorted(halves[0])}, replicas on {sorted(halves[1])}"
                                       if halves else ""))
        everywhere = os.sched_getaffinity(0)
        try:  # started on their own CPUs (a child inherits them), so that even their speed probes run there
            if halves:  # and each half takes turns computing among its own peers only, as a machine would
                os.sched_setaffinity(0, halves[0])
                mesh.env["MESHD_CPU_TURN_LOCK"] = str(workdir / "cpu-turn-route")
            first = mesh.start_peer(model=model_dir, layers=ranges[0], extra=flags, timeout=PEER_START_TIMEOUT_S)
            # one numerics class for all (a class measured apart on a busy machine may differ, and peers of
            # different classes never share a route or a prefix)
            flags += ["--numerics", first.get("/status")["numerics"]]
            hops = [first, *mesh.start_peers([{"model": model_dir, "layers": r, "extra": flags} for r in ranges[1:]],
                                             timeout=PEER_START_TIMEOUT_S)]
            if halves:
                os.sched_setaffinity(0, halves[1])
                mesh.env["MESHD_CPU_TURN_LOCK"] = str(workdir / "cpu-turn-replicas")
            mesh.start_peers([{"model": model_dir, "layers": r, "extra": [*flags, "--prefill-only"]} for r in ranges],
                             timeout=PEER_START_TIMEOUT_S)
        finally:
            os.sched_setaffinity(0, everywhere)
            mesh.env.pop("MESHD_CPU_TURN_LOCK", None)
        workers, route_only = mesh.start_peers(
            [{"extra": ["--prefill-workers", str(min_tokens), "--speculative", "off"]},
             {"extra": ["--prefill-workers", "0", "--speculative", "off"]}],
            timeout=PEER_START_TIMEOUT_S)
        mesh.wait_covered(model_id, timeout=COVER_TIMEOUT_S)
        clients = {name: OpenAI(base_url=f"http://{peer.api}/v1", api_key="meshd", timeout=REQUEST_TIMEOUT_S,
                                max_retries=0) for name, peer in (("workers", workers), ("route", route_only))}
        route_ids = [p.peer_id for p in sorted(hops, key=lambda p: p.get("/status")["range"][0])]
        for name, entry in (("workers", workers), ("route", route_only)):
            stream_chat(clients[name], model_id, [{"role": "user", "content": f"warm up {name}"}], 2)
            wait_for_speed_checks(entry, say)
            _wait_for_route(mesh, entry, model_id, route_ids)
        for repeat in range(cfg.repeats):
            prompt = build_prompt(codec.tokenizer, cfg.prompt_tokens, start=repeat * 1231).text
            messages = [{"role": "user", "content": prompt}]
            prompts.append(messages)
            for mode in ("route", "workers"):
                entry = workers if mode == "workers" else route_only
                row = _round(clients[mode], entry, model_id, messages, cfg)
                row.update(repeat=repeat, prefill_on=mode, prompt_tokens=len(codec.encode_chat(messages)))
                rounds.append(row)
                busy = row["busy"]
                estimate = row["estimate"]
                say(f"round {repeat + 1}, prefill on the {mode}: first token after {row['ttft_ms']:.0f} ms; the "
                    f"busy session kept {busy['rate_kept'] or 0:.2f} of its rate (longest step "
                    f"{busy['longest_gap_ms'] or 0:.0f} ms)" + (
                        f"; estimated {estimate['workers_ms']:.0f} ms on workers, {estimate['route_ms']:.0f} ms on "
                        f"the route: {'workers' if row['workers_used'] else 'the route'} prefilled it"
                        if estimate else "; no workers weighed" if mode == "workers" else ""))
        worker_stats = workers.get("/stats")["prefill_workers"]
        numerics = hops[0].get("/status")["numerics"]
        # what each route hop's batcher says of the decode stall its prefill chunks caused (all rounds)
        stalls = [{key: hop.get("/stats")["batches"][key]
                   for key in ("decode_stall_bound_ms", "decodes_between_slices", "prefill_chunks")} for hop in hops]
    say(f"one process: {model_id} with transformers generate(), {threads} torch threads")
    base: Baseline | None = None
    single: list[dict[str, Any]] = []
    for messages in prompts:
        ids = codec.encode_chat(messages)
        if base is None:
            base = Baseline(model_dir, ids, cfg.new_tokens, dtype=_dtype(cfg.dtype, model_dir))
        base.prompt_ids, base.token_ids = ids, None
        measured = base.measure(1)
        single.append({"ttft_ms": round(measured.ttft_ms, 1),
                       "tokens": [codec.token_text(t) for t in measured.token_ids]})
    for row in rounds:
        reference = single[row["repeat"]]
        row["identical_to_one_process"] = row.pop("tokens") == reference["tokens"]
        row["one_process_ttft_ms"] = reference["ttft_ms"]
    return {"benchmark": "prefill-workers", "model": model_id, "peers": cfg.peers,
            "ranges": [list(r) for r in ranges], "numerics": numerics,
            "cpus": {"route": sorted(halves[0]), "replicas": sorted(halves[1])} if halves else None,
            "prompt_tokens": cfg.prompt_tokens, "busy_tokens": cfg.busy_tokens, "new_tokens": cfg.new_tokens,
            "rounds": rounds, "summary": _summary(rounds), "entry_prefill_workers": worker_stats,
            "route_hops_stall": stalls,
            "identical": all(r["identical_to_one_process"] for r in rounds),
            "machine": machine_meta(threads, load_start)}


def _wait_for_route(mesh: LocalMesh, entry: LocalPeer, model_id: str, route_ids: list[str]) -> None:
    """Until the entry's routes go through the route's peers, as they must (the replicas only prefill)."""
    def planned() -> bool:
        route = entry.get(f"/route?model={model_id}")
        if [h["peer_id"] for h in route["hops"]] != route_ids:
            raise BenchError("planned through " + ", ".join(
                f"{h['peer_id'][:8]} ({h['compute_ms']} ms compute, {h['seam_ms']} ms seam)" for h in route["hops"])
                + f" instead of {', '.join(p[:8] for p in route_ids)}")
        return True

    mesh.wait_until(planned, ROUTE_TIMEOUT_S, "routes planned through the route's peers, not the replicas")


def _round(client: Any, entry: LocalPeer, model_id: str, messages: list[dict], cfg: WorkersBenchConfig,
           ) -> dict[str, Any]:
    before = entry.get("/stats")["prefill_workers"]
    busy = BusySession(client, model_id, cfg.busy_tokens)
    busy.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while len(busy.times) < 4 and busy.error is None and busy.is_alive():
        if time.monotonic() > deadline:
            raise BenchError("the busy session streamed nothing")
        time.sleep(0.05)
    # the prompt goes once the busy session has run a while alone, and always while it has most of its
    # reply still to stream (on a fast model the window would outlast it)
    window_ends = time.monotonic() + BASELINE_WINDOW_S
    while time.monotonic() < window_ends and len(busy.times) < cfg.busy_tokens // 4 and busy.is_alive():
        time.sleep(0.01)
    sent = time.perf_counter()
    reply = stream_chat(client, model_id, messages, cfg.new_tokens)
    first = sent + reply.ttft_ms / 1000
    busy.join(REQUEST_TIMEOUT_S)
    if busy.error is not None:
        raise BenchError(f"the busy session failed: {busy.error}")
    after = entry.get("/stats")["prefill_workers"]
    used = after["used"] - before["used"]
    weighed = after["planned"] + after["declined"] > before["planned"] + before["declined"]
    return {"ttft_ms": round(reply.ttft_ms, 1), "tokens": reply.tokens, "busy": busy_figures(busy.times, sent, first),
            "workers": after["last"]["workers"] if used else None, "estimate": after["last"] if weighed else None,
            "workers_used": used}


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def median(mode: str, pick: Any) -> float | None:
        values = [v for r in rounds if r["prefill_on"] == mode and (v := pick(r)) is not None]
        return round(statistics.median(values), 3) if values else None

    out: dict[str, Any] = {}
    for mode in ("route", "workers"):
        out[mode] = {"ttft_ms": median(mode, lambda r: r["ttft_ms"]),
                     "busy_rate_kept": median(mode, lambda r: r["busy"]["rate_kept"]),
                     "busy_longest_gap_ms": median(mode, lambda r: r["busy"]["longest_gap_ms"])}
    route, workers = out["route"], out["workers"]
    out["ttft_workers_over_route"] = (round(workers["ttft_ms"] / route["ttft_ms"], 3)
                                      if workers["ttft_ms"] and route["ttft_ms"] else None)
    return out


def format_workers_summary(report: dict) -> str:
    lines = [f"prefill workers, {report['model']} on {report['peers']} peers and {report['peers']} prefill-only "
             f"replicas ({report['numerics']})",
             f"{'round':>5} {'prefill on':>10} {'prompt':>7} {'TTFT ms':>9} {'busy kept':>10} {'busy gap ms':>12} "
             f"{'identical':>10}"]
    for row in report["rounds"]:
        busy = row["busy"]
        lines.append(f"{row['repeat'] + 1:>5} {row['prefill_on']:>10} {row['prompt_tokens']:>7} {row['ttft_ms']:>9.1f} "
                     f"{busy['rate_kept'] or 0:>10.2f} {busy['longest_gap_ms'] or 0:>12.1f} "
                     f"{'yes' if row['identical_to_one_process'] else 'NO':>10}")
    ratio = report["summary"]["ttft_workers_over_route"]
    lines.append(f"time to first token on workers / on the route: {ratio if ratio is not None else '-'}")
    return "\n".join(lines)


def main_workers(cfg: WorkersBenchConfig, out: Path) -> int:
    """``meshctl bench --prefill-workers``: run, write the JSON, print the table; 1 if a reply changed
    or the workers were never used."""
    report = written_report(lambda say: run_workers_bench(cfg, say), out, format_workers_summary)
    if report is None:
        return 1
    if not report["identical"]:
        print("meshctl bench: a reply differs from one process's", file=sys.stderr)
        return 1
    if not any(r["workers_used"] for r in report["rounds"] if r["prefill_on"] == "workers"):
        print("meshctl bench: the entry never prefilled on workers (its cost model chose the route every time)",
              file=sys.stderr)
        return 1
    return 0
