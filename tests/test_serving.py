"""The serving benchmark: its workload, load drivers, figures and one-process ceiling, then ``meshctl bench
--serve`` end to end on the tiny model. No figure is checked against a speed (docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from meshd.bench.batch_server import OneProcessServer, Served
from meshd.bench.continuous_server import PREFILL_CHUNK, ContinuousServer
from meshd.bench.serving import (
    CONTINUOUS,
    ONE_PROCESS,
    RATE_FRACTIONS,
    Completed,
    ServeRequest,
    mixed_requests,
    poisson_arrivals,
    run_closed,
    run_poisson,
    serving_ratios,
    share_rate,
    spread,
    summarize,
    sustained_rate,
    sustained_share,
)
from meshd.bench.workload import Prompt
from meshd.errors import ShapeMismatch
from meshd.runtime.numerics import default_numerics
from tests.helpers import ONEDNN, needs_onednn


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_the_same_seed_gives_the_same_requests_with_exact_lengths(tokenizer):
    first = mixed_requests(tokenizer, 24, seed=7, prompt_tokens=(8, 16, 32), new_tokens=(4, 12))
    again = mixed_requests(tokenizer, 24, seed=7, prompt_tokens=(32, 16, 8), new_tokens=(12, 4))
    other = mixed_requests(tokenizer, 24, seed=8, prompt_tokens=(8, 16, 32), new_tokens=(4, 12))

    assert first == again
    assert [(len(r.prompt.ids), r.new_tokens) for r in first] != [(len(r.prompt.ids), r.new_tokens) for r in other]
    assert [r.index for r in first] == list(range(24))
    assert {len(r.prompt.ids) for r in first} == {8, 16, 32}  # every length drawn, each exact
    assert {r.new_tokens for r in first} == {4, 12}
    for r in first:
        assert tokenizer(r.prompt.text)["input_ids"] == r.prompt.ids  # the API sees the same tokens
    same_length = [r.prompt.text for r in first if len(r.prompt.ids) == 16]
    assert len(set(same_length)) > 1  # prompts of one length start at different places


def test_poisson_arrivals_have_exponential_gaps_of_mean_one_over_the_rate():
    times = poisson_arrivals(4000, 5.0, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(times)]

    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.06)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    assert sum(g < 0.2 for g in gaps) / len(gaps) == pytest.approx(1 - 2.718281828 ** -1, abs=0.03)
    assert poisson_arrivals(50, 5.0, seed=3) == times[:50]
    assert poisson_arrivals(50, 10.0, seed=3) == pytest.approx([t / 2 for t in times[:50]])  # same pattern
    assert poisson_arrivals(50, 5.0, seed=4) != times[:50]


def test_spread_takes_percentiles_by_rank():
    got = spread(range(1, 101), scale=2.0)

    assert got == {"count": 100, "p50": 102.0, "p95": 192.0, "p99": 200.0, "mean": 101.0}
    assert spread([]) == {"count": 0}
    assert spread([0.004]) == {"count": 1, "p50": 0.004, "p95": 0.004, "p99": 0.004, "mean": 0.004}


def _done(index: int, arrival: float, tokens: tuple[float, ...], asked: int | None = None, sent: float | None = None
          ) -> Completed:
    return Completed(index, asked or len(tokens), len(tokens), arrival, arrival if sent is None else sent, tokens, "")


def test_summary_counts_latency_from_the_scheduled_arrival_and_throughput_over_the_wall_time():
    done = [_done(0, 0.0, (0.5, 0.6, 0.8)), _done(1, 1.0, (1.2, 1.3, 1.4, 2.0), sent=1.01)]
    got = summarize(done)

    assert got["requests"] == 2 and got["output_tokens"] == 7 and got["wall_s"] == 2.0
    assert got["tok_s"] == 3.5 and got["req_s"] == 1.0
    assert got["ttft_ms"]["count"] == 2 and got["ttft_ms"]["p50"] == 500.0 and got["ttft_ms"]["mean"] == 350.0
    assert got["latency_ms"]["p50"] == 1000.0 and got["latency_ms"]["p99"] == 1000.0
    assert got["itl_ms"]["count"] == 5  # gaps within each request (100, 200; 100, 100, 600), never across two
    assert got["itl_ms"]["p50"] == pytest.approx(100.0) and got["itl_ms"]["p99"] == pytest.approx(600.0)
    assert got["send_lag_ms_max"] == pytest.approx(10.0)
    assert got["tokens_exact"] is True
    assert summarize([_done(0, 0.0, (0.1, 0.2), asked=3)])["tokens_exact"] is False


def _poisson(*p95_ms: float | None) -> dict[str, dict]:
    rates = ("0.5", "1", "2", "4")
    return {r: {"ttft_ms": {"count": 0} if p is None else {"count": 4, "p95": p}} for r, p in zip(rates, p95_ms,
                                                                                                 strict=False)}


def test_the_sustained_rate_is_the_highest_rate_with_p95_ttft_under_the_bound_at_it_and_below():
    assert sustained_rate(_poisson(100, 300, 900, 2500), 1.0) == 2.0
    assert sustained_rate(_poisson(100, 300, 900, 950), 1.0) == 4.0
    assert sustained_rate(_poisson(100, 1200, 900, 950), 1.0) == 0.5  # a miss caps it, whatever comes after
    assert sustained_rate(_poisson(1000, 10, 10, 10), 1.0) is None  # exactly the bound is not under it
    assert sustained_rate({"10": _poisson(5)["0.5"], "9": _poisson(50)["0.5"]}, 1.0) == 10.0  # keys read as numbers
    assert sustained_rate({}, 1.0) is None


def test_serving_ratios_compare_each_mesh_with_the_one_process_in_the_same_run():
    one = {"closed": {"4": {"tok_s": 40.0}, "8": {"tok_s": 50.0}}, "poisson": _poisson(100, 200, 300, 3000)}
    mesh1 = {"closed": {"4": {"tok_s": 30.0}, "8": {"tok_s": 45.0}}, "poisson": _poisson(100, 200, 3000, 3000)}
    mesh3 = {"closed": {"4": {"tok_s": 20.0}}, "poisson": _poisson(3000, 3000, 3000, 3000)}
    got = serving_ratios({ONE_PROCESS: one, "1": mesh1, "3": mesh3}, 2.0)

    assert got["closed_loop_ratio"] == {"4": {"1": 0.75, "3": 0.5}, "8": {"1": 0.9, "3": None}}
    assert got["sustained_rate"] == {ONE_PROCESS: 2.0, "1": 1.0, "3": None}
    assert got["sustained_ratio"] == {"1": 0.5, "3": None}
    assert "continuous_closed_loop_ratio" not in got and "continuous_sustained_ratio" not in got

    continuous = {"closed": {"4": {"tok_s": 60.0}, "8": {"tok_s": 90.0}}, "poisson": _poisson(100, 200, 300, 400)}
    both = serving_ratios({ONE_PROCESS: one, CONTINUOUS: continuous, "1": mesh1, "3": mesh3}, 2.0)
    assert both["closed_loop_ratio"] == got["closed_loop_ratio"]  # the continuous one process is no mesh
    assert both["sustained_ratio"] == got["sustained_ratio"]
    assert both["continuous_closed_loop_ratio"] == {"4": {"1": 0.5, "3": 0.3333}, "8": {"1": 0.5, "3": None}}
    assert both["sustained_rate"][CONTINUOUS] == 4.0
    assert both["continuous_sustained_ratio"] == {"1": 0.25, "3": None}


def test_the_share_rate_is_that_share_of_the_sustained_rate_and_a_mesh_sustains_it_only_at_it_and_below():
    assert share_rate(sustained_rate(_poisson(100, 300, 900, 2500), 1.0), 0.8) == 1.6  # 0.8 of 2/s
    assert share_rate(4.0, 1 / 3) == 1.33  # to 3 significant digits
    assert share_rate(sustained_rate(_poisson(1000, 10), 1.0), 0.8) is None  # nothing sustained: no share of it
    assert share_rate(2.0, 0.0) is None  # none asked for

    # the share rate tested on every server: a mesh that keeps the bound there sustains it, one that
    # misses it there (or below it) does not, whatever the rates around it gave
    mesh_keeps = {**_poisson(100, 300, 2500), "1.6": {"ttft_ms": {"count": 4, "p95": 900}}}
    mesh_misses = {**_poisson(100, 300, 2500), "1.6": {"ttft_ms": {"count": 4, "p95": 2100}}}
    mesh_below = {**_poisson(100, 2100, 100), "1.6": {"ttft_ms": {"count": 4, "p95": 100}}}
    sustained = {CONTINUOUS: 2.0, **{k: sustained_rate(v, 2.0) for k, v in
                                     (("1", mesh_keeps), ("2", mesh_misses), ("3", mesh_below))}}
    assert sustained == {CONTINUOUS: 2.0, "1": 1.6, "2": 1.0, "3": 0.5}
    got = sustained_share(1.6, 0.8, {ONE_PROCESS: None, **sustained})
    assert got == {"share": 0.8, "share_rate": 1.6, "sustains_share": {"1": True, "2": False, "3": False}}
    none = sustained_share(None, 0.8, {CONTINUOUS: None, "1": None, "3": 0.5})
    assert none["share_rate"] is None and none["sustains_share"] == {"1": None, "3": None}


def _requests(n: int, tokens: int = 3) -> list[ServeRequest]:
    return [ServeRequest(i, Prompt("x", [1]), tokens) for i in range(n)]


class _SlowServer:
    """Serves one request at a time, ``step_s`` per token, and counts how many callers wait at once."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.lock = threading.Lock()
        self.inside = self.most_inside = 0
        self.count = threading.Lock()

    def __call__(self, request: ServeRequest) -> Served:
        with self.count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        with self.lock:
            times = []
            for _ in range(request.new_tokens):
                time.sleep(self.step_s)
                times.append(time.perf_counter())
        with self.count:
            self.inside -= 1
        return Served(tuple(times), request.new_tokens, f"reply {request.index}")


def test_poisson_arrivals_keep_their_schedule_while_the_server_is_busy():
    server = _SlowServer(0.01)
    arrivals = [0.0, 0.005, 0.01, 0.015]  # all due while the first is still being served
    done = run_poisson(server, _requests(4), arrivals)

    assert [c.index for c in done] == [0, 1, 2, 3] and [c.arrival_s for c in done] == arrivals
    assert all(c.sent_s - c.arrival_s < 0.02 for c in done)
    assert server.most_inside == 4
    assert done[-1].ttft_s > 0.05  # it waited for three requests of three tokens each: counted in its TTFT
    assert all(c.text == f"reply {c.index}" for c in done)


def test_closed_loop_clients_send_their_next_request_when_the_last_one_ends():
    server = _SlowServer(0.002)
    done = run_closed(server, _requests(7), clients=3)

    assert [c.index for c in done] == list(range(7))
    assert server.most_inside == 3
    assert all(c.arrival_s == c.sent_s for c in done)
    for c in done:  # when a request is sent, fewer than three others are still waiting for their answer
        waiting = [o for o in done if o is not c and o.sent_s <= c.sent_s and o.token_s[-1] > c.sent_s]
        assert len(waiting) < 3


def _greedy(model, ids: list[int], n: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=5)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=config)
    return out[0, len(ids):].tolist()


def test_the_one_process_server_answers_each_request_with_its_own_greedy_tokens_in_batches(tiny_model, tokenizer):
    requests = mixed_requests(tokenizer, 8, seed=1, prompt_tokens=(8, 24, 40), new_tokens=(3, 9, 17))
    with OneProcessServer(tiny_model, torch.float32, torch.get_num_threads()) as server:
        server.max_batch = 4
        done = run_closed(lambda r: server.serve(r.prompt.ids, r.new_tokens), requests, clients=4)
        stats = server.stats()
        served = server.serve(requests[0].prompt.ids, requests[0].new_tokens)
        early = server.serve([1, 2, 3], 1)
    single = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    assert sum(int(size) * n for size, n in stats["batch_sizes"].items()) == 8
    assert 2 <= stats["largest_batch"] <= 4  # requests that arrived while a batch computed ran together
    assert all(c.completion_tokens == c.new_tokens == len(c.token_s) for c in done)
    assert all(list(c.token_s) == sorted(c.token_s) and c.ttft_s > 0 for c in done)
    # left-padded batched greedy generate in float32 gives each prompt the tokens it gets alone
    assert served.token_ids == tuple(_greedy(single, requests[0].prompt.ids, requests[0].new_tokens))
    for c, r in zip(done, requests, strict=True):
        assert c.text == tokenizer.decode(_greedy(single, r.prompt.ids, r.new_tokens), skip_special_tokens=True)
    assert early.completion_tokens == 1 and len(early.token_times) == 1


def test_the_one_process_server_answers_a_short_request_before_its_batch_ends(tiny_model):
    with OneProcessServer(tiny_model, torch.float32, torch.get_num_threads()) as server:
        server.max_batch = 2
        requests = [ServeRequest(0, Prompt("", [7, 8, 9]), 2), ServeRequest(1, Prompt("", [7, 8, 9, 10]), 60)]
        done = run_poisson(lambda r: server.serve(r.prompt.ids, r.new_tokens), requests, [0.0, 0.0])
        stats = server.stats()

    if stats["batch_sizes"] == {"2": 1}:  # both made one batch: the short one left it at its own length
        assert done[0].token_s[-1] < done[1].token_s[2]
    assert [c.completion_tokens for c in done] == [2, 60]


def test_the_one_process_server_computes_int8_where_the_peers_do(tiny_model):
    from dataclasses import replace

    from meshd.runtime.int8 import int8_bytes

    numerics = replace(default_numerics(torch.float32, "cpu"), weights="int8")
    with OneProcessServer(tiny_model, torch.float32, 1, numerics=numerics) as server:
        served = server.serve([7, 8, 9], 5)
        quantized = int8_bytes(server.model)
    with ContinuousServer(tiny_model, numerics, 1) as continuous:
        same = continuous.serve([7, 8, 9], 5)
    assert quantized > 0 and served.completion_tokens == 5
    assert served.token_ids == same.token_ids  # the same int8 linears in both one-process servers


def test_the_one_process_server_refuses_an_empty_request(tiny_model):
    with OneProcessServer(tiny_model, torch.float32, 1, warm_up=False) as server, pytest.raises(ValueError):
        server.serve([], 4)


def test_the_continuous_server_answers_each_request_with_its_own_greedy_tokens_in_shared_steps(tiny_model,
                                                                                               tokenizer):
    # one prompt longer than a prefill chunk: computed in two chunks, still the tokens of one pass
    requests = mixed_requests(tokenizer, 8, seed=1, prompt_tokens=(8, 24, PREFILL_CHUNK + 40), new_tokens=(3, 9, 17))
    assert any(len(r.prompt.ids) > PREFILL_CHUNK for r in requests)
    with ContinuousServer(tiny_model, default_numerics(torch.float32, "cpu"), torch.get_num_threads()) as server:
        server.max_batch = 4
        done = run_closed(lambda r: server.serve(r.prompt.ids, r.new_tokens), requests, clients=4)
        stats = server.stats()
        early = server.serve([1, 2, 3], 1)
        held = len(server.shard.kv)
    single = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    assert 2 <= stats["largest_batch"] <= 4 and stats["prefill_slices"] >= 8
    # each request's first token comes from its prefill, every later one from a decode step
    assert sum(int(size) * n for size, n in stats["batch_sizes"].items()) == sum(r.new_tokens - 1 for r in requests)
    assert all(c.completion_tokens == c.new_tokens == len(c.token_s) for c in done)
    assert all(list(c.token_s) == sorted(c.token_s) and c.ttft_s > 0 for c in done)
    for c, r in zip(done, requests, strict=True):
        assert c.text == tokenizer.decode(_greedy(single, r.prompt.ids, r.new_tokens), skip_special_tokens=True)
    assert early.completion_tokens == 1 and len(early.token_times) == 1
    assert held == 0  # every finished request's KV is released


@needs_onednn
def test_the_continuous_server_computes_waiting_prompts_together_as_a_peer_does(tiny_model):
    """In a class whose GEMM rows do not depend on the row count, prompts waiting together are computed
    as one chunk (a chunk too long to join runs alone); each request gets the tokens it gets alone, and
    a bad one fails alone."""
    prompts = [[(3 * i + 5 * j) % 200 + 4 for j in range(n)] for i, n in enumerate((8, 24, PREFILL_CHUNK + 40, 17))]
    prompts.append([7, 10**6, 9])  # a token id outside the vocabulary
    with ContinuousServer(tiny_model, ONEDNN, 1, warm_up=False) as server:
        assert server.shard.prefills_share_rows
        alone = [server.serve(p, 6).text for p in prompts[:-1]]
        server.max_batch = 8
        server.reset_stats()
        real = server.shard.forward_batch
        decoding, go = threading.Event(), threading.Event()

        def held(bundles):  # the first decode step waits until every other prompt is queued
            server.shard.forward_batch = real
            decoding.set()
            go.wait(30)
            return real(bundles)

        server.shard.forward_batch = held
        with ThreadPoolExecutor(max_workers=len(prompts) + 1) as pool:
            first = pool.submit(server.serve, prompts[0], 20)
            assert decoding.wait(30)
            rest = [pool.submit(server.serve, p, 6) for p in prompts]
            while len(server._queue) < len(prompts):
                time.sleep(0.001)
            go.set()
            with pytest.raises(ShapeMismatch, match="token ids"):
                rest[-1].result()
            texts = [f.result().text for f in rest[:-1]]
            assert first.result().completion_tokens == 20
        runs = server.stats()["prefill_runs"]
        assert len(server.shard.kv) == 0
    assert texts == alone
    # the four good prompts and the bad one waited together: the short ones went as one chunk, the long
    # prompt's first chunk alone
    assert runs["1"] >= 2 and max(int(k) for k in runs) >= 3


@needs_onednn
def test_the_continuous_server_takes_prompts_arriving_during_a_runs_first_slice_into_it(tiny_model):
    """A prompt computing alone starts again with the prompts that arrive during its first slice, as at
    a peer: one run computes all of them, and each request gets the tokens it gets alone."""
    prompts = [[(3 * i + 5 * j) % 200 + 4 for j in range(n)] for i, n in enumerate((8, 24, 17))]
    with ContinuousServer(tiny_model, ONEDNN, 1, warm_up=False) as server:
        alone = [server.serve(p, 6).text for p in prompts]
        server.reset_stats()
        server.max_batch = 8
        server.slice_s = 1e-9  # a layer a slice
        run_layer = server.shard._run_layer
        queued = threading.Event()

        def gated(*args):  # the lone prompt's first layer waits until the others are queued
            queued.wait(30)
            return run_layer(*args)

        server.shard._run_layer = gated
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            first = pool.submit(server.serve, prompts[0], 6)
            give_up = time.monotonic() + 30  # a run that never starts, or prompts never queued, fail the test
            while server.stats()["prefill_runs"] != {"1": 1}:  # its run has started
                assert time.monotonic() < give_up, "the lone prompt's run did not start"
                time.sleep(0.001)
            rest = [pool.submit(server.serve, p, 6) for p in prompts[1:]]
            while len(server._queue) < len(rest):
                assert time.monotonic() < give_up, "the other prompts did not queue"
                time.sleep(0.001)
            queued.set()
            texts = [f.result().text for f in (first, *rest)]
        stats = server.stats()
        assert len(server.shard.kv) == 0
    assert texts == alone
    assert stats["prefill_runs"] == {"3": 1} and stats["prefill_restarts"] == 1


def test_the_continuous_server_lets_a_request_join_while_another_decodes(tiny_model):
    with ContinuousServer(tiny_model, default_numerics(torch.float32, "cpu"), 1) as server:
        server.max_batch = 2
        with ThreadPoolExecutor(max_workers=1) as pool:
            long = pool.submit(server.serve, [7, 8, 9], 400)
            while server.stats()["batches"] == 0:  # the long request is decoding
                time.sleep(0.001)
            short = server.serve([7, 8, 9, 10], 3)
            long_done = long.result()
        stats = server.stats()

    # a static batch would make it wait for all 400 steps; here it runs beside them
    assert short.token_times[-1] < long_done.token_times[-1]
    assert stats["batch_sizes"].get("2", 0) >= 2 and short.completion_tokens == 3


def test_a_bad_request_on_the_continuous_server_fails_alone(tiny_model):
    with ContinuousServer(tiny_model, default_numerics(torch.float32, "cpu"), 1, warm_up=False) as server:
        server.max_batch = 2
        with ThreadPoolExecutor(max_workers=2) as pool:
            good = pool.submit(server.serve, [7, 8, 9], 20)
            bad = pool.submit(server.serve, [7, 10**6, 9], 5)  # a token id outside the vocabulary
            with pytest.raises(ShapeMismatch, match="token ids"):
                bad.result()
            assert good.result().completion_tokens == 20
        assert len(server.shard.kv) == 0
        with pytest.raises(ValueError):
            server.serve([], 4)


def test_a_failed_decode_step_fails_its_requests_and_the_continuous_server_serves_on(tiny_model):
    with ContinuousServer(tiny_model, default_numerics(torch.float32, "cpu"), 1, warm_up=False) as server:
        server.max_batch = 2
        real = server.shard.forward_batch

        def broken(bundles):
            server.shard.forward_batch = real  # once
            raise RuntimeError("the step broke")

        server.shard.forward_batch = broken
        with pytest.raises(RuntimeError, match="the step broke"):
            server.serve([7, 8, 9], 5)
        assert len(server.shard.kv) == 0  # its KV went with it
        assert server.serve([7, 8, 9], 5).completion_tokens == 5


LOAD_FIELDS = ("requests", "output_tokens", "wall_s", "tok_s", "req_s", "ttft_ms", "itl_ms", "latency_ms",
               "send_lag_ms_max", "tokens_exact", "replies_identical", "batches")


@pytest.mark.slow
def test_bench_serve_on_tiny_model_reports_every_load_on_every_server(tmp_path, tiny_model):
    out = tmp_path / "serve.json"
    run = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl_main", "bench", "--serve",
         "--model", str(tiny_model), "--peers", "1,2", "--serve-requests", "3", "--serve-clients", "2",
         "--serve-prompt-tokens", "8,24", "--serve-new-tokens", "4,10", "--seed", "5", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())

    assert report["mode"] == "serve" and report["model"] == "tiny" and report["dtype"] == "float32"
    for key in ("torch_threads", "cpu_count", "meshd_version", "torch_version", "date", "load_avg_1m"):
        assert report[key], key
    assert "cpu_model" in report and "cpu_features" in report  # empty where the system does not say
    assert report["seed"] == 5 and report["requests_per_load"] == 3 and report["ttft_bound_s"] == 2.0
    assert len(report["workload"]) == 3
    assert all(w["prompt_tokens"] in (8, 24) and w["new_tokens"] in (4, 10) for w in report["workload"])
    assert report["clients"] == [2] and report["rates_from"]["server"] == CONTINUOUS
    capacity = report["rates_from"]["capacity_req_s"]
    assert capacity == report["servers"][CONTINUOUS]["capacity_req_s"]
    # the rates: fractions of the one process's capacity, then 0.8 of the rate it sustained over those
    grid = [float(f"{capacity * f:.3g}") for f in RATE_FRACTIONS]
    share = report["share_rate"]
    assert report["share"] == 0.8 and share == report["servers"][CONTINUOUS]["share_rate"]
    over_grid = sustained_rate({k: v for k, v in report["servers"][CONTINUOUS]["poisson"].items() if float(k) in grid},
                               2.0)
    assert share == (None if over_grid is None else float(f"{0.8 * over_grid:.3g}"))
    assert report["rates"] == sorted({*grid, *([share] if share is not None else [])})
    assert set(report["sustains_share"]) == {"1", "2"}
    for k, sustains in report["sustains_share"].items():
        assert sustains == (None if share is None else (report["sustained_rate"][k] or 0.0) >= share)
    assert set(report["servers"]) == {ONE_PROCESS, CONTINUOUS, "1", "2"}
    for name, server in report["servers"].items():
        assert list(server["closed"]) == ["2"] and sorted(map(float, server["poisson"])) == report["rates"], name
        for figures in [*server["closed"].values(), *server["poisson"].values()]:
            assert [k for k in LOAD_FIELDS if k not in figures] == [], name
            assert figures["requests"] == 3 and figures["tokens_exact"] is True, name
            assert figures["output_tokens"] == sum(w["new_tokens"] for w in report["workload"])
            assert figures["tok_s"] > 0 and figures["req_s"] > 0
            for spread_of in ("ttft_ms", "latency_ms"):
                got = figures[spread_of]
                assert got["count"] == 3 and 0 < got["p50"] <= got["p95"] <= got["p99"], (name, spread_of)
            assert figures["itl_ms"]["count"] > 0
    assert report["servers"]["2"]["ranges"] == [[0, 2], [2, 4]] and len(report["servers"]["2"]["peer_ids"]) == 2
    for k in ("1", "2"):
        hops = report["servers"][k]["closed"]["2"]["batches"]
        assert len(hops) == int(k) and all(h["decode_steps"] > 0 for h in hops)  # reset, then this load's
    assert report["servers"][ONE_PROCESS]["closed"]["2"]["batches"][0]["max_batch"] == 2
    assert set(report["closed_loop_ratio"]["2"]) == {"1", "2"}
    assert all(v > 0 for v in report["closed_loop_ratio"]["2"].values())
    assert set(report["sustained_rate"]) == {ONE_PROCESS, CONTINUOUS, "1", "2"}
    assert set(report["sustained_ratio"]) == set(report["continuous_sustained_ratio"]) == {"1", "2"}
    assert set(report["continuous_closed_loop_ratio"]["2"]) == {"1", "2"}
    assert report["servers"][CONTINUOUS]["closed"]["2"]["batches"][0]["max_batch"] == 2
    assert report["tokens_exact"] is True
    assert report["replies_identical"] is True  # float32: the meshes answer what the one process answered
    assert "sustained Poisson rate" in run.stdout and "one process" in run.stdout and "one, continuous" in run.stdout
    assert "mesh of 2, 2 clients" in run.stderr
