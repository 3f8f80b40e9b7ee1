"""The serving benchmark (``meshctl bench --serve``): throughput and latency under arriving requests.

A mesh is a server, so it is measured as one: a seeded mix of requests (prompt and output lengths
drawn from small sets, every output exactly its length) arrives either as a Poisson process at
several rates or from N closed-loop clients (each sends its next request when its last one ends).
The same requests, with the same arrival times, go to every server in one run: the whole model in
this process serving them in static batches (:class:`~meshd.bench.batch_server.OneProcessServer`, what
transformers' ``generate()`` gives one machine), the whole model as one shard in this process batching
step by step (:class:`~meshd.bench.continuous_server.ContinuousServer`, the mesh's engine without the
network), and meshes of each peer count (real ``meshd run`` processes, even layer ranges, asked
through the head's OpenAI API with streamed ``/v1/completions``). Ratios are taken against each of
the two one-process servers.

Every time is taken by the client: a request's TTFT and latency count from its scheduled arrival
(so a wait for a busy server counts), inter-token latency is the gap between successive streamed
chunks of one request. Poisson rates default to fractions of the continuous one-process server's
closed-loop capacity (the higher one process's), measured first; a server *sustains* a rate when its
p95 TTFT stays under a bound there and at every lower rate tested. One more rate, a share of the rate the
continuous one process sustains, is tested on every server, so that whether a mesh sustains that share
is measured at it rather than read off the nearest rates around it.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.bench.batch_server import OneProcessServer, Served, ThreadedServer
from meshd.bench.continuous_server import ContinuousServer
from meshd.bench.runner import (
    BenchError,
    PeerClasses,
    Say,
    Setup,
    machine_meta,
    quiet_transformers,
    running_mesh,
    splittable_model,
    wait_for_speed_checks,
    written_report,
)
from meshd.bench.workload import Prompt, build_prompt, stream_completion
from meshd.cli.demo import even_ranges
from meshd.progress import progress
from meshd.runtime.numerics import Numerics
from meshd.stats import percentile

PROMPT_TOKENS = (32, 64, 128, 256, 512)
NEW_TOKENS = (16, 32, 64, 128)
CLIENTS = (4, 8)
PEERS = (1, 3)
REQUESTS = 8
# of the continuous one process's capacity, when no rates are given: one past it, so that a server
# keeping the bound at every rate up to its capacity is told from one that keeps it beyond
RATE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.5)
TTFT_BOUND_S = 2.0
# of the continuous one process's sustained rate: the share a mesh is asked to sustain, tested as a rate of its own
SHARE = 0.8
ONE_PROCESS = "one_process"  # static batches
CONTINUOUS = "one_process_continuous"  # step by step
ONE_PROCESS_SERVERS = (ONE_PROCESS, CONTINUOUS)


@dataclass(frozen=True)
class ServeConfig:
    model: str  # a built-in model's name or a model directory
    peers: tuple[int, ...] = PEERS
    clients: tuple[int, ...] = CLIENTS
    rates: tuple[float, ...] = ()  # requests/s; empty: RATE_FRACTIONS of the continuous one process's capacity
    requests: int = REQUESTS  # per load
    seed: int = 0
    ttft_bound_s: float = TTFT_BOUND_S
    share: float = SHARE  # 0: no rate of its own for the share
    prompt_tokens: tuple[int, ...] = PROMPT_TOKENS
    new_tokens: tuple[int, ...] = NEW_TOKENS
    dtype: str = "auto"
    workdir: Path | None = None


@dataclass(frozen=True)
class ServeRequest:
    index: int
    prompt: Prompt
    new_tokens: int


@dataclass(frozen=True)
class Load:
    """One load: ``clients`` closed-loop clients, or Poisson arrivals at ``rate`` requests/s."""

    kind: str  # "closed" or "poisson"
    level: float  # clients, or requests/s

    @property
    def key(self) -> str:
        return rate_key(self.level)

    @property
    def label(self) -> str:
        return f"{int(self.level)} clients" if self.kind == "closed" else f"Poisson {self.level:g}/s"


def rate_key(value: float) -> str:
    """A rate or a client count as a JSON key: "0.25", "4"."""
    return f"{value:g}"


def mixed_requests(tokenizer: Any, count: int, seed: int, prompt_tokens: Iterable[int] = PROMPT_TOKENS,
                   new_tokens: Iterable[int] = NEW_TOKENS) -> list[ServeRequest]:
    """``count`` requests, each with a prompt length and an output length drawn from the given sets and
    a prompt cut from its own place in the text (no two share a prefix by design); same seed, same list."""
    rng = random.Random(seed)
    lengths, outputs = sorted(set(prompt_tokens)), sorted(set(new_tokens))
    if not lengths or not outputs or min(lengths) < 1 or min(outputs) < 1 or count < 1:
        raise BenchError("the serving workload needs at least one request, prompt length and output length")
    out: list[ServeRequest] = []
    for index in range(count):
        n, m, start = rng.choice(lengths), rng.choice(outputs), rng.randrange(64)
        out.append(ServeRequest(index, build_prompt(tokenizer, n, start=start), m))
    return out


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Arrival times in seconds: the first at 0, then exponential gaps of mean ``1 / rate``. The gaps
    come from ``seed`` alone and are scaled by the rate, so every rate sees the same pattern."""
    if rate <= 0:
        raise BenchError(f"a Poisson rate must be above 0, got {rate}")
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(1.0) / rate
    return times


@dataclass(frozen=True)
class Completed:
    """One request as its client saw it; times in seconds from the start of its load."""

    index: int
    new_tokens: int  # asked for
    completion_tokens: int  # got
    arrival_s: float  # when it was due (Poisson) or sent (closed loop)
    sent_s: float
    token_s: tuple[float, ...]  # each streamed token (or chunk)
    text: str

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.token_s[-1] - self.arrival_s

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_s)]


ServeFn = Callable[[ServeRequest], Served]


def _complete(serve: ServeFn, request: ServeRequest, t0: float, arrival_s: float | None = None) -> Completed:
    """Send ``request`` now; it was due at ``arrival_s`` (None: now, as a closed-loop client sends)."""
    sent = time.perf_counter() - t0
    arrival_s = sent if arrival_s is None else arrival_s
    got = serve(request)
    if not got.token_times:
        raise BenchError(f"request {request.index} got no tokens")
    return Completed(request.index, request.new_tokens, got.completion_tokens, arrival_s, sent,
                     tuple(t - t0 for t in got.token_times), got.text)


class _Start:
    """The start of a load, once every one of its ``parties`` threads is running: no thread's start-up
    delays a request that is due at once."""

    def __init__(self, parties: int) -> None:
        self.t0 = 0.0
        self._barrier = threading.Barrier(parties, action=self._mark)

    def _mark(self) -> None:
        self.t0 = time.perf_counter()

    def wait(self) -> float:
        self._barrier.wait()
        return self.t0


def run_poisson(serve: ServeFn, requests: list[ServeRequest], arrivals: list[float]) -> list[Completed]:
    """Each request sent at its arrival time from a thread of its own, whatever the others are doing."""
    start = _Start(len(requests))

    def one(i: int) -> Completed:
        t0 = start.wait()
        wait = t0 + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return _complete(serve, requests[i], t0, arrivals[i])

    with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix="poisson") as pool:
        return list(pool.map(one, range(len(requests))))


def run_closed(serve: ServeFn, requests: list[ServeRequest], clients: int) -> list[Completed]:
    """``clients`` clients taking the requests in order, each sending its next as soon as its last ends;
    they all send their first at once."""
    todo = iter(requests)
    lock = threading.Lock()
    start = _Start(clients)

    def client(_i: int) -> list[Completed]:
        done: list[Completed] = []
        t0 = start.wait()
        while True:
            with lock:
                request = next(todo, None)
            if request is None:
                return done
            done.append(_complete(serve, request, t0))

    with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="client") as pool:
        done = [c for got in pool.map(client, range(clients)) for c in got]
    return sorted(done, key=lambda c: c.index)


def spread(values: Iterable[float], scale: float = 1.0) -> dict[str, Any]:
    """``{"count", "p50", "p95", "p99", "mean"}`` of ``values`` times ``scale``; only ``count`` when empty."""
    data = sorted(v * scale for v in values)
    if not data:
        return {"count": 0}
    return {"count": len(data), **{f"p{round(q * 100)}": round(percentile(data, q), 3) for q in (0.5, 0.95, 0.99)},
            "mean": round(statistics.fmean(data), 3)}


def summarize(done: list[Completed]) -> dict[str, Any]:
    """A load's figures: throughput over its wall time (start to last token) and latency spreads in ms."""
    wall = max(c.token_s[-1] for c in done)
    tokens = sum(c.completion_tokens for c in done)
    return {
        "requests": len(done), "output_tokens": tokens, "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 3) if wall > 0 else None,
        "req_s": round(len(done) / wall, 4) if wall > 0 else None,
        "ttft_ms": spread((c.ttft_s for c in done), 1000),
        "itl_ms": spread((g for c in done for g in c.gaps_s), 1000),
        "latency_ms": spread((c.latency_s for c in done), 1000),
        # how late a client sent a request after it was due: arrivals kept their schedule when small
        "send_lag_ms_max": round(max(max(0.0, c.sent_s - c.arrival_s) for c in done) * 1000, 3),
        "tokens_exact": all(c.completion_tokens == c.new_tokens for c in done),
    }


def sustained_rate(poisson: dict[str, dict], bound_s: float) -> float | None:
    """The highest tested rate at which p95 TTFT stays under ``bound_s``, there and at every lower rate;
    None when the lowest rate already misses it."""
    best = None
    for key in sorted(poisson, key=float):
        p95 = poisson[key]["ttft_ms"].get("p95")
        if p95 is None or p95 >= bound_s * 1000:
            break
        best = float(key)
    return best


def share_rate(sustained: float | None, share: float) -> float | None:
    """``share`` of a ``sustained`` rate, to 3 significant digits; None when nothing is sustained or no
    share is asked for."""
    return None if sustained is None or share <= 0 else float(f"{sustained * share:.3g}")


def sustained_share(rate: float | None, share: float, sustained: dict[str, float | None]) -> dict[str, Any]:
    """``share_rate`` (``share`` of the continuous one process's sustained rate, tested on every server)
    and ``sustains_share``: for each mesh, whether it sustains that rate (null when there is none: the
    continuous one process sustained no rate, or no share was asked for)."""
    meshes = [k for k in sustained if k not in ONE_PROCESS_SERVERS]
    return {"share": share, "share_rate": rate,
            "sustains_share": {k: None if rate is None else (sustained[k] or 0.0) >= rate for k in meshes}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def serving_ratios(servers: dict[str, dict], bound_s: float) -> dict[str, Any]:
    """Within the run: each server's sustained rate; against the static one process, each mesh's
    closed-loop tok/s over its own at the same level and each mesh's sustained rate over its own
    (``closed_loop_ratio``, ``sustained_ratio``); the same against the continuous one process where
    it ran (``continuous_closed_loop_ratio``, ``continuous_sustained_ratio``)."""
    meshes = {k: v for k, v in servers.items() if k not in ONE_PROCESS_SERVERS}
    sustained = {k: sustained_rate(v["poisson"], bound_s) for k, v in servers.items()}
    out: dict[str, Any] = {"sustained_rate": sustained}
    for against, prefix in ((ONE_PROCESS, ""), (CONTINUOUS, "continuous_")):
        one = servers.get(against)
        if one is None:
            continue
        out[f"{prefix}closed_loop_ratio"] = {
            level: {k: _ratio(mesh["closed"].get(level, {}).get("tok_s"), got["tok_s"]) for k, mesh in meshes.items()}
            for level, got in one["closed"].items()}
        out[f"{prefix}sustained_ratio"] = {k: _ratio(sustained[k], sustained[against]) for k in meshes}
    return out


@dataclass(frozen=True)
class Target:
    """What loads run against: how one request is served, what to do before each load (reset the batch
    counts), and the batch counts after it."""

    label: str
    serve: ServeFn
    begin: Callable[[Load], None]
    batches: Callable[[], Any]


def drive(load: Load, serve: ServeFn, requests: list[ServeRequest], seed: int) -> list[Completed]:
    if load.kind == "closed":
        return run_closed(serve, requests, int(load.level))
    return run_poisson(serve, requests, poisson_arrivals(len(requests), load.level, seed))


def run_loads(target: Target, loads: list[Load], requests: list[ServeRequest], seed: int,
              reference: dict[int, str], say: Say, advance: Callable[[], None]) -> dict[str, dict]:
    """Every load against ``target``: ``{"closed": {CLIENTS: figures}, "poisson": {RATE: figures}}``,
    each with the target's batch counts and how many replies equal ``reference`` (filled from the first
    load when empty)."""
    out: dict[str, dict] = {"closed": {}, "poisson": {}}
    for load in loads:
        target.begin(load)
        done = drive(load, target.serve, requests, seed)
        if not reference:
            reference.update({c.index: c.text for c in done})
        figures = summarize(done)
        figures["replies_identical"] = sum(reference.get(c.index) == c.text for c in done)
        figures["batches"] = target.batches()
        out[load.kind][load.key] = figures
        say(f"{target.label}, {load.label}: {figures['tok_s']:.2f} tok/s, {figures['req_s']:.3f} req/s; TTFT p50/p95 "
            f"{figures['ttft_ms']['p50']:.0f}/{figures['ttft_ms']['p95']:.0f} ms, ITL p50 "
            f"{figures['itl_ms'].get('p50', 0):.1f} ms; {figures['replies_identical']}/{len(done)} replies as the "
            "first server's")
        advance()
    return out


def _one_process_target(label: str, server: ThreadedServer, poisson_batch: int) -> Target:
    def begin(load: Load) -> None:
        server.max_batch = int(load.level) if load.kind == "closed" else poisson_batch
        server.reset_stats()

    return Target(label, lambda r: server.serve(r.prompt.ids, r.new_tokens), begin,
                  lambda: [server.stats() | {"max_batch": server.max_batch}])


def run_serve(cfg: ServeConfig, say: Say) -> dict:
    """Measure every load on every server and return the report object."""
    if cfg.requests < 1 or cfg.ttft_bound_s <= 0 or any(r <= 0 for r in cfg.rates):
        raise BenchError("--serve-requests must be at least 1, rates and --serve-ttft-bound-s above 0")
    if not 0 <= cfg.share < 1:
        raise BenchError(f"--serve-share must be at least 0 and below 1, got {cfg.share:g}")
    quiet_transformers()
    import torch
    from transformers import AutoTokenizer

    from meshd.runtime.shard import resolve_dtype

    model_dir, n_layers = splittable_model(cfg.model, cfg.peers, say)
    model_id = model_dir.name
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = mixed_requests(tokenizer, cfg.requests, cfg.seed, cfg.prompt_tokens, cfg.new_tokens)
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        say(f"note: 1-minute load average is {load_start:.2f} before starting; other work skews the figures")
    held = resolve_dtype(cfg.dtype, model_dir)
    classes = PeerClasses(model_dir)
    threads = torch.get_num_threads()
    clients = sorted(cfg.clients)
    n_rates = (len(cfg.rates) or len(RATE_FRACTIONS)) + (cfg.share > 0)
    say(f"serving {model_id} ({str(held).removeprefix('torch.')}, {threads} torch threads): {cfg.requests} requests "
        f"per load, seed {cfg.seed}, {sum(len(r.prompt.ids) for r in requests)} prompt + "
        f"{sum(r.new_tokens for r in requests)} new tokens in all; the peers compute as "
        f"{classes.of(cfg.dtype).name}, measured here and pinned")
    reference: dict[int, str] = {}
    servers: dict[str, dict] = {}
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="meshd-serve-"))
    try:
        with progress("serve", (len(clients) + n_rates) * (len(ONE_PROCESS_SERVERS) + len(cfg.peers)), "loads",
                      say=lambda _line: None) as bar:
            servers[CONTINUOUS], rates = _serve_continuous(model_dir, classes.of(cfg.dtype), threads, cfg, requests,
                                                           reference, say, bar.advance)
            if len(rates) < n_rates:  # the share was not a rate of its own: the loads counted for it do not run
                bar.advance(len(ONE_PROCESS_SERVERS) + len(cfg.peers))
            gc.collect()  # each one-process model, before the next server loads its own
            loads = [Load("closed", c) for c in clients] + [Load("poisson", r) for r in rates]
            servers[ONE_PROCESS] = _serve_static(model_dir, held, classes.of(cfg.dtype), threads, cfg, requests, loads,
                                                 reference, say, bar.advance)
            gc.collect()
            for k in sorted(cfg.peers):
                servers[str(k)] = _serve_mesh(model_dir, model_id, even_ranges(n_layers, k), threads,
                                              workdir / f"serve-peers{k}", cfg, classes, requests, loads,
                                              reference, say, bar.advance)
    except Exception:
        say(f"peer logs kept in {workdir}")
        raise
    if cfg.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    meta = {
        "mode": "serve", "model": model_id, "model_dir": str(model_dir), "dtype": str(held).removeprefix("torch."),
        **machine_meta(threads, load_start),
        "seed": cfg.seed, "requests_per_load": cfg.requests, "ttft_bound_s": cfg.ttft_bound_s,
        "prompt_tokens_choices": sorted(set(cfg.prompt_tokens)), "new_tokens_choices": sorted(set(cfg.new_tokens)),
        "workload": [{"prompt_tokens": len(r.prompt.ids), "new_tokens": r.new_tokens} for r in requests],
        "clients": clients, "rates": rates,
        "rates_from": "given" if cfg.rates else {
            "server": CONTINUOUS, "capacity_req_s": servers[CONTINUOUS]["capacity_req_s"],
            "fractions": list(RATE_FRACTIONS)},
    }
    every = [f for server in servers.values() for kind in ("closed", "poisson") for f in server[kind].values()]
    ratios = serving_ratios(servers, cfg.ttft_bound_s)
    return {**meta, "servers": servers, **ratios,
            **sustained_share(servers[CONTINUOUS].get("share_rate"), cfg.share, ratios["sustained_rate"]),
            "tokens_exact": all(f["tokens_exact"] for f in every),
            "replies_identical": all(f["replies_identical"] == f["requests"] for f in every)}


def _serve_continuous(model_dir: Path, numerics: Numerics, threads: int, cfg: ServeConfig,
                      requests: list[ServeRequest], reference: dict[int, str], say: Say,
                      advance: Callable[[], None]) -> tuple[dict, list[float]]:
    """Every load on the continuous one-process server (the whole model as one shard of the peers'
    class, ``numerics``), closed loops first: its figures and the Poisson rates, which without
    ``cfg.rates`` are fractions of its closed-loop capacity (the higher of the one process's two), and
    then ``cfg.share`` of the rate it sustained over those (:func:`share_rate`), a rate of its own."""
    clients = sorted(cfg.clients)
    poisson_batch = max(clients)
    say(f"one process, continuous: loading {model_dir.name} as one shard ({numerics.name}), up to the "
        f"closed-loop level at once, {poisson_batch} under Poisson arrivals")
    with ContinuousServer(model_dir, numerics, threads) as server:
        target = _one_process_target("one process, continuous", server, poisson_batch)
        closed = run_loads(target, [Load("closed", c) for c in clients], requests, cfg.seed, reference, say,
                           advance)["closed"]
        capacity = max(closed.values(), key=lambda f: f["req_s"] or 0.0)
        rates = sorted(cfg.rates) or [float(f"{capacity['req_s'] * f:.3g}") for f in RATE_FRACTIONS]
        say(f"one process, continuous: capacity {capacity['req_s']:.3f} req/s ({capacity['tok_s']:.2f} tok/s); "
            f"Poisson rates {', '.join(f'{r:g}' for r in rates)}/s")
        poisson = run_loads(target, [Load("poisson", r) for r in rates], requests, cfg.seed, reference, say,
                            advance)["poisson"]
        sustained = sustained_rate(poisson, cfg.ttft_bound_s)
        share = share_rate(sustained, cfg.share)
        if share is not None and rate_key(share) not in poisson:
            say(f"one process, continuous: sustained {sustained:g}/s; every server is also asked for {cfg.share:g} "
                f"of it, {share:g}/s")
            poisson |= run_loads(target, [Load("poisson", share)], requests, cfg.seed, reference, say,
                                 advance)["poisson"]
            rates = sorted([*rates, share])
    return {"closed": closed, "poisson": poisson, "capacity_req_s": capacity["req_s"], "share_rate": share,
            "poisson_max_batch": poisson_batch, "numerics": numerics.name}, rates


def _serve_static(model_dir: Path, dtype: Any, numerics: Numerics, threads: int, cfg: ServeConfig,
                  requests: list[ServeRequest], loads: list[Load], reference: dict[int, str], say: Say,
                  advance: Callable[[], None]) -> dict:
    """Every load on the static one-process server (transformers, its linears as the peers',
    ``numerics``), batches of up to the closed-loop level, and of the most clients under Poisson arrivals."""
    poisson_batch = max(cfg.clients)
    say(f"one process: loading {model_dir.name}, batches of up to the closed-loop level, {poisson_batch} under "
        "Poisson arrivals")
    with OneProcessServer(model_dir, dtype, threads, numerics=numerics) as server:
        figures = run_loads(_one_process_target("one process", server, poisson_batch), loads, requests, cfg.seed,
                            reference, say, advance)
    return {**figures, "poisson_max_batch": poisson_batch}


def _serve_mesh(model_dir: Path, model_id: str, ranges: list[tuple[int, int]], threads: int, workdir: Path,
                cfg: ServeConfig, classes: PeerClasses, requests: list[ServeRequest], loads: list[Load],
                reference: dict[int, str], say: Say, advance: Callable[[], None]) -> dict:
    """Every load through a mesh holding ``ranges``, each hop's batch counts reset before each load."""
    setup = Setup("", classes.pinned(("--dtype", cfg.dtype)))
    with running_mesh(model_dir, model_id, ranges, threads, workdir, say, setup) as mesh:
        def serve(request: ServeRequest) -> Served:
            got = stream_completion(mesh.client, model_id, request.prompt.text, request.new_tokens)
            return Served(tuple(got.started + t for t in got.chunk_s), got.completion_tokens, got.text)

        def begin(_load: Load) -> None:
            for hop in mesh.hops:
                hop.get("/stats?reset=1")

        serve(ServeRequest(-1, requests[0].prompt, 4))  # warm-up: connections, routes, first-call allocations
        wait_for_speed_checks(mesh.peers[0], say)
        k = len(ranges)
        target = Target(f"mesh of {k}", serve, begin, lambda: [hop.get("/stats")["batches"] for hop in mesh.hops])
        figures = run_loads(target, loads, requests, cfg.seed, reference, say, advance)
        return {**figures, "ranges": [list(r) for r in ranges], "peer_ids": [h.peer_id for h in mesh.hops],
                "numerics": mesh.hops[0].get("/status")["numerics"]}


def main_serve(cfg: ServeConfig, out: Path) -> int:
    """``meshctl bench --serve``: run, write the JSON, print the table; 1 if a request got a wrong count."""
    from meshd.bench.report import format_serve_summary

    report = written_report(lambda say: run_serve(cfg, say), out, format_serve_summary)
    if report is None:
        return 1
    if not report["tokens_exact"]:
        print("meshctl bench: a request got a different number of tokens than it asked for", file=sys.stderr)
        return 1
    return 0
