"""``meshctl bench`` end to end on the tiny model: a complete report, and the mesh's tokens equal the baseline's.

No figure is checked against a speed: the machines are shared (see docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import psutil
import pytest

from meshd.bench.baseline import BaselineResult
from meshd.bench.report import build_report, format_summary
from meshd.bench.runner import CpuSnapshot, MeshResult, compute_share, cpu_share, cpu_snapshot
from meshd.bench.wakeup import idle_policy, idle_residency, idle_since
from meshd.bench.workload import StreamTiming
from meshd.models.gguf_export import write_gguf
from tests.test_gguf import native

TOP_LEVEL = (
    "model", "prompt_tokens", "new_tokens", "torch_threads", "cpu_count", "cpu_model", "meshd_version", "date",
    "baseline_tok_s", "mesh_tok_s", "ratio", "ttft_ms", "seam_ms_p50", "seam_ms_p95", "seam_ms",
    "bytes_per_token_per_seam", "aggregate_tok_s", "batching_gain", "peer_rss_mb", "model_size_mb",
    "baseline_rss_mb", "tokens_identical", "profile",
)


def test_the_compute_share_is_what_each_hop_computed_during_the_load_over_its_wall_time():
    before = [{"decode_compute_s": 10.0, "prefill_compute_s": 1.0}, {"decode_compute_s": 0.0, "prefill_compute_s": 0.0}]
    after = [{"decode_compute_s": 13.0, "prefill_compute_s": 2.0}, {"decode_compute_s": 2.5, "prefill_compute_s": 0.5}]
    share = compute_share(before, after, 10.0)
    assert share == {"hops": [0.4, 0.3], "decode": 0.55, "prefill": 0.15, "summed": 0.7}
    # a hop whose counters were reset meanwhile (a restarted peer) adds nothing rather than a negative share
    assert compute_share(after[:1], before[:1], 10.0)["summed"] == 0.0


def test_the_cpu_share_is_the_cpu_time_each_process_and_the_machine_used_over_the_load():
    before = CpuSnapshot(client=5.0, peers=[100.0, 50.0], machine=1000.0, loops=[20.0, None])
    after = CpuSnapshot(client=6.5, peers=[112.0, 50.0], machine=1018.0, loops=[21.5, 4.0])
    share = cpu_share(before, after, 10.0)
    assert share["client"] == 0.15 and share["peers"] == [1.2, 0.0] and share["machine"] == 1.8
    # the event loop's part of a peer's share; unknown where either snapshot could not read it
    assert share["loops"] == [0.15, None]
    assert share["cpus"] >= 1
    # a peer that ended meanwhile counts nothing rather than a negative share
    assert cpu_share(after, before, 10.0)["peers"] == [0.0, 0.0]
    assert cpu_share(after, before, 10.0)["loops"] == [0.0, None]


def test_a_cpu_snapshot_counts_this_process_and_a_peer_that_has_gone_as_nothing_more():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    first = cpu_snapshot([os.getpid(), child.pid])
    me = psutil.Process()
    while sum(me.cpu_times()[:2]) < first.client + 0.05:  # CPU times move in clock ticks: spend a few
        sum(i * i for i in range(10_000))
    second = cpu_snapshot([os.getpid(), child.pid])
    assert second.client > first.client and second.peers[0] > first.peers[0]
    assert first.peers[1] == second.peers[1] == 0.0
    assert second.machine >= first.machine
    # this test spent its CPU on the main thread: the snapshot counts it as the process's event loop
    if sys.platform == "linux":
        assert first.loops[0] is not None and second.loops[0] is not None
        assert second.loops[0] > first.loops[0]
        # read just after the process's times, and each rounded to clock ticks: within two ticks of it
        assert second.loops[0] <= second.peers[0] + 0.02
    assert first.loops[1] == second.loops[1] == 0.0


def test_a_cpu_snapshot_counts_only_the_main_thread_as_the_event_loop():
    if sys.platform != "linux":
        pytest.skip("thread ids match the process id only on Linux")
    me = psutil.Process()
    first = cpu_snapshot([os.getpid()])

    def spend() -> None:  # CPU times move in clock ticks: spend a few on another thread
        start = sum(me.cpu_times()[:2])
        while sum(me.cpu_times()[:2]) < start + 0.1:
            sum(i * i for i in range(10_000))

    worker = threading.Thread(target=spend)
    worker.start()
    worker.join()
    second = cpu_snapshot([os.getpid()])
    assert first.loops[0] is not None and second.loops[0] is not None
    assert second.peers[0] - first.peers[0] >= 0.1 - 1e-9  # ticks as floats: 4.2 - 4.1 < 0.1
    assert second.loops[0] - first.loops[0] < second.peers[0] - first.peers[0] - 0.05


def _hop_stats(prefill_compute_ms: float, runs: int) -> dict:
    window = {"p50": 1.0, "p95": 1.0, "mean": 1.0, "count": 10}
    prefill = {"p50": 1.0, "p95": 1.0, "mean": 1.0, "count": runs}
    return {"deserialize_ms": window, "queue_ms": window, "compute_ms": window, "serialize_ms": window,
            "entry_seam_ms": window, "seam_ms": window, "decode_bundle_bytes": {"p50": 88.0, "count": 10},
            "prefill_seam_ms": prefill, "prefill_queue_ms": prefill,
            "prefill_compute_ms": prefill | {"mean": prefill_compute_ms}}


def test_the_first_token_split_takes_its_parts_out_of_the_runs_mean_time_like_the_parts():
    # three runs of one chunk per hop, the last one slow: summed over hops the parts' means are 1200 ms,
    # more than the median TTFT (1160) though the runs spent 12 ms more than that on average
    runs = [StreamTiming("x", 8, first_s, first_s + 0.5, 8) for first_s in (1.16, 1.15, 1.33)]
    mesh = MeshResult(peers=3, ranges=[(0, 1), (1, 2), (2, 4)], runs=runs, baseline_tok_s=[10.0, 10.0],
                      identical=[True] * 3, hop_stats=[_hop_stats(ms, 3) for ms in (370.0, 430.0, 394.0)],
                      peer_ids=["a", "b", "c"], rss_mb=[1.0] * 3)
    baseline = BaselineResult(token_ids=[1], decode_tok_s=10.0, ttft_ms=1000.0, runs_tok_s=[10.0],
                              runs_ttft_ms=[1000.0], rss_mb=1.0, model_bytes=1, torch_threads=1)
    split = build_report({}, baseline, [mesh])["ttft_split"]["3"]
    assert split["ttft_mean_ms"] == pytest.approx(1213.333, abs=1e-3)
    assert split["prefill_compute_ms"] == pytest.approx(1194.0)
    # compute 1194 + queue 3 + seams 3 out of the mean: 13.3 ms left, where the median would leave -40
    assert split["other_ms"] == pytest.approx(13.333, abs=1e-3)


def test_the_idle_policy_is_read_from_sysfs_and_none_where_the_kernel_does_not_say(tmp_path):
    assert idle_policy(tmp_path) == {"driver": None, "governor": None, "guest_halt_poll_ns": None}
    cpuidle = tmp_path / "devices/system/cpu/cpuidle"
    cpuidle.mkdir(parents=True)
    (cpuidle / "current_driver").write_text("haltpoll\n")
    (cpuidle / "current_governor").write_text("menu\n")
    assert idle_policy(tmp_path) == {"driver": "haltpoll", "governor": "menu", "guest_halt_poll_ns": None}
    (cpuidle / "current_governor_ro").write_text("haltpoll\n")  # the one in use, where the kernel has both
    params = tmp_path / "module/haltpoll/parameters"
    params.mkdir(parents=True)
    (params / "guest_halt_poll_ns").write_text("200000\n")
    assert idle_policy(tmp_path) == {"driver": "haltpoll", "governor": "haltpoll", "guest_halt_poll_ns": 200000}
    (params / "guest_halt_poll_ns").write_text("garbage\n")
    assert idle_policy(tmp_path)["guest_halt_poll_ns"] is None


def test_idle_residency_sums_each_state_over_the_cpus_and_skips_what_it_cannot_read(tmp_path):
    assert idle_residency(tmp_path) == {}
    cpus = tmp_path / "devices/system/cpu"
    for cpu, (polled, halted) in {"cpu0": (1_500_000, 2_000_000), "cpu1": (250_000, 4_000_000)}.items():
        for index, (name, micros) in enumerate([("POLL", polled), ("haltpoll idle", halted)]):
            state = cpus / cpu / "cpuidle" / f"state{index}"
            state.mkdir(parents=True)
            (state / "name").write_text(f"{name}\n")
            (state / "time").write_text(f"{micros}\n")
    (cpus / "cpufreq").mkdir()  # not a CPU
    broken = cpus / "cpu1/cpuidle/state2"
    broken.mkdir()
    (broken / "name").write_text("C2\n")
    (broken / "time").write_text("garbage\n")
    before = idle_residency(tmp_path)
    assert before == {"POLL": pytest.approx(1.75), "haltpoll idle": pytest.approx(6.0)}
    (cpus / "cpu0/cpuidle/state0/time").write_text("2000000\n")
    (cpus / "cpu1/cpuidle/state1/time").write_text("7000000\n")
    assert idle_since(before, tmp_path) == {"POLL": 0.5, "haltpoll idle": 3.0}
    # a state that appeared only later counts from zero
    assert idle_since({"POLL": 2.0}, tmp_path) == {"POLL": 0.25, "haltpoll idle": 9.0}


def test_reports_name_the_cpu_and_the_kernel_features_it_has(tmp_path):
    from meshd.bench.report import _cpus
    from meshd.runtime.cpu_info import KERNEL_FEATURES, _cpuinfo, kernel_features

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse2 avx2 avx512f amx_int8\n\n"
                    "processor\t: 1\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse2 avx2 avx512f amx_int8\n")
    assert _cpuinfo(str(info)) == ("Some CPU 9000", frozenset({"fpu", "sse2", "avx2", "avx512f", "amx_int8"}))
    assert _cpuinfo(str(tmp_path / "missing"))[1] == frozenset()  # a system that does not say
    assert set(kernel_features()) <= set(KERNEL_FEATURES)
    assert _cpus({"cpu_count": 2, "cpu_model": "Some CPU 9000", "cpu_features": ["avx2", "avx512f"]}) == (
        "2 CPUs (Some CPU 9000, avx2 avx512f)")
    assert _cpus({"cpu_count": 2}) == "2 CPUs"  # a report from before the fields


def test_the_summary_says_how_idle_cpus_are_handled_next_to_the_wake_ups():
    mesh = MeshResult(peers=1, ranges=[(0, 4)], runs=[StreamTiming("x", 8, 0.2, 0.7, 8)], baseline_tok_s=[10.0],
                      identical=[True], hop_stats=[_hop_stats(100.0, 1)], peer_ids=["a"], rss_mb=[1.0])
    baseline = BaselineResult(token_ids=[1], decode_tok_s=10.0, ttft_ms=100.0, runs_tok_s=[10.0],
                              runs_ttft_ms=[100.0], rss_mb=1.0, model_bytes=1, torch_threads=1)
    trip = {"hot": {"p50": 10.0}, "idle": {"p50": 50.0}}
    meta = {"model": "m", "prompt_tokens": 8, "new_tokens": 8, "torch_threads": 1, "cpu_count": 2}

    def wake_line(policy: dict | None, idle_s_by_state: dict | None = None) -> str:
        wakeup: dict = {"idle_ms": 20.0, "thread_handoff_us": trip, "process_round_trip_us": trip}
        if policy is not None:
            wakeup["idle_policy"] = policy
        if idle_s_by_state is not None:
            wakeup["idle_s_by_state"] = idle_s_by_state
        summary = format_summary(build_report({**meta, "wakeup": wakeup}, baseline, [mesh]))
        return next(line for line in summary.splitlines() if line.startswith("wake-ups"))

    assert wake_line(None).endswith("process round trip 10 / 50")  # a report from before the field
    assert wake_line({"driver": None, "governor": None, "guest_halt_poll_ns": None}).endswith("10 / 50")
    assert wake_line({"driver": "haltpoll", "governor": "haltpoll", "guest_halt_poll_ns": 0}).endswith(
        "10 / 50 (cpuidle haltpoll/haltpoll, an idle vCPU halts at once)")
    assert wake_line({"driver": "haltpoll", "governor": "haltpoll", "guest_halt_poll_ns": 200000}).endswith(
        "(cpuidle haltpoll/haltpoll, an idle vCPU polls up to 200 us before it halts)")
    # what the idle CPUs did while it ran, which the setting alone does not say
    halting = {"driver": "haltpoll", "governor": "haltpoll", "guest_halt_poll_ns": 0}
    assert wake_line(halting, {"POLL": 30.0, "haltpoll idle": 90.0}).endswith(
        "(cpuidle haltpoll/haltpoll, an idle vCPU halts at once; while it ran, idle CPUs polled 25% of their "
        "120 s idle)")
    assert wake_line(halting, {"haltpoll idle": 60.0}).endswith("polled 0% of their 60 s idle)")
    assert wake_line(halting, {}).endswith("an idle vCPU halts at once)")
    assert wake_line({"driver": "intel_idle", "governor": "menu", "guest_halt_poll_ns": None}).endswith(
        "10 / 50 (cpuidle intel_idle/menu)")
    # the poll time is the haltpoll governor's: under another one it decides nothing
    assert wake_line({"driver": "acpi_idle", "governor": "menu", "guest_halt_poll_ns": 0}).endswith(
        "10 / 50 (cpuidle acpi_idle/menu)")


@pytest.mark.slow
def test_bench_on_tiny_model_writes_a_complete_report(tmp_path, tiny_model):
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl_main", "bench", "--model", str(tiny_model), "--peers", "1,2",
         "--concurrency", "1,2", "--prompt-tokens", "16", "--new-tokens", "16", "--runs", "2",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=240, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())

    assert [k for k in TOP_LEVEL if k not in report] == []
    assert report["model"] == "tiny"
    assert report["prompt_tokens"] == 16 and report["new_tokens"] == 16
    assert report["tokens_identical"] is True
    assert report["tokens_identical_by_peers"] == {"1": True, "2": True}
    assert report["split_identical"] is True
    assert report["dtype"] == "float32" and report["numerics"]
    for key in ("baseline_tok_s", "seam_ms_p50", "seam_ms_p95", "bytes_per_token_per_seam", "batching_gain",
                "model_size_mb", "baseline_rss_mb", "torch_threads"):
        assert report[key] > 0, key
    for table in ("mesh_tok_s", "ratio"):
        assert set(report[table]) == {"1", "2"} and all(v > 0 for v in report[table].values()), table
    assert set(report["ttft_ms"]) == {"baseline", "1", "2"} and all(v > 0 for v in report["ttft_ms"].values())
    assert set(report["aggregate_tok_s"]) == {"1", "2"} and all(v > 0 for v in report["aggregate_tok_s"].values())
    assert report["batching_gain_concurrency"] == 2
    # the ceiling at the same batch, measured on either side of the largest mesh, and the ratio to their mean
    before, after = report["ceiling_runs_tok_s"]["2"]
    assert before > 0 and after > 0 and report["ceiling_tok_s"]["2"] == pytest.approx((before + after) / 2, abs=0.01)
    assert report["ceiling_ratio"]["2"] == pytest.approx(
        report["aggregate_tok_s"]["2"] / report["ceiling_tok_s"]["2"], rel=0.01)
    assert "one process, batched generate() before the mesh: batch 2: " in run.stderr
    assert "one process, batched generate() after the mesh: batch 2: " in run.stderr
    assert len(report["batches"]) == 2 and all(b["decode_steps"] > 0 for b in report["batches"])
    assert all(sum(b["prefill_runs"].values()) > 0 for b in report["batches"])
    assert "hop 1 prefill computes (prompts' chunks computed together: count) " in run.stdout
    assert f"{report['batches'][1]['prefill_restarts']} started again to take in prompts" in run.stdout
    assert set(report["compute_share"]) == {"1", "2"}
    for share in report["compute_share"].values():
        assert len(share["hops"]) == 2 and all(v > 0 for v in share["hops"]) and share["decode"] > 0
        assert share["summed"] == pytest.approx(sum(share["hops"]), abs=1e-3)
        assert share["summed"] == pytest.approx(share["decode"] + share["prefill"], abs=1e-3)
    assert set(report["cpu_share"]) == {"1", "2"}
    for used in report["cpu_share"].values():
        # CPU times come in clock ticks: a short load's client may show none, but the peers computed
        assert used["client"] >= 0 and len(used["peers"]) == 2 and sum(used["peers"]) > 0
        assert used["machine"] >= 0.5 * sum(used["peers"])
        # each peer's event loop, part of that peer's CPU (both in clock ticks, read one after the other)
        assert len(used["loops"]) == 2 and all(loop is not None for loop in used["loops"])
        assert all(0 <= loop <= peer + 0.1 for loop, peer in zip(used["loops"], used["peers"], strict=True))
    assert "CPUs busy during each load, the client + each hop (the machine in all): c=1: " in run.stdout
    assert "of that, the hops' event loops (transport, sessions, API), and their CPU ms per token: c=1: " in run.stdout
    assert set(report["baseline_tok_s_by_peers"]) == {"1", "2"}
    assert len(report["runs_detail"]["baseline"]["tok_s"]) == 3 * 2  # before the meshes, then after each
    for kind in ("thread_handoff_us", "process_round_trip_us"):
        assert all(report["wakeup"][kind][when]["p50"] > 0 for when in ("hot", "idle")), kind
    assert set(report["wakeup"]["idle_policy"]) == {"driver", "governor", "guest_halt_poll_ns"}
    idle = report["wakeup"]["idle_s_by_state"]
    assert set(idle) == set(idle_residency()) and all(v >= 0 for v in idle.values())
    if idle:  # a kernel with cpuidle: the CPUs were idle for some of the run (2 peers on the machine's CPUs)
        assert sum(idle.values()) > 0
    assert [len(report["peer_rss_mb"][k]) for k in ("1", "2")] == [1, 2]
    assert all(v > 0 for values in report["peer_rss_mb"].values() for v in values)
    assert report["seam_ms"]["1"]["p50"] is None  # one peer: no hidden-state seam, only the entry's
    assert report["seam_ms"]["1"]["entry_p50"] > 0
    hops = report["profile"]["2"]["hops"]
    assert [h["layers"] for h in hops] == [[0, 2], [2, 4]]
    assert all(h["compute_ms"]["count"] > 0 and h["compute_ms"]["p50"] > 0 for h in hops)
    for part in ("deserialize_ms", "queue_ms"):
        assert all(h[part]["count"] > 0 and h[part]["mean"] >= 0 for h in hops), part
    assert hops[0]["serialize_ms"]["count"] > 0 and hops[0]["serialize_ms"]["mean"] > 0
    assert hops[1]["serialize_ms"]["count"] == 0  # the tail sends tokens, not bundles
    assert all(h["network_ms"] is not None and h["network_ms"] >= 0 for h in hops)
    # one traversal of the route per decode token: the entry's bundle into the head, one hidden seam
    assert report["seam_transfers_per_token"] == {"1": 1.0, "2": 2.0}
    ttft = report["ttft_split"]["2"]
    assert ttft["prefill_compute_ms"] > 0 and ttft["prefill_seams_ms"] > 0 and ttft["other_ms"] is not None
    split = report["profile"]["2"]["split"]
    assert set(split) == {"deserialize_ms", "queue_ms", "compute_ms", "serialize_ms", "network_ms", "other_ms"}
    assert "tokens identical to the baseline: yes" in run.stdout
    assert "mesh of 2: concurrency 2" in run.stderr


@pytest.mark.slow
@native
def test_the_gguf_bench_measures_both_engines_against_llama_cpp(tmp_path, tiny_model):
    gguf_file = write_gguf(tiny_model, tmp_path / "tiny-q8_0.gguf", "q8_0")
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl_main", "bench", "--model", str(gguf_file), "--format", "gguf",
         "--peers", "1,2", "--concurrency", "1", "--prompt-tokens", "16", "--new-tokens", "12", "--runs", "1",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "MESHD_HOME": str(tmp_path / "home")},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["format"] == "gguf" and report["quantization"] == "q8_0"
    assert report["file_bytes"] == gguf_file.stat().st_size
    assert set(report["wakeup"]["idle_s_by_state"]) == set(idle_residency())
    assert set(report["paths"]) == {"llama.cpp", "torch"}
    assert report["paths"]["llama.cpp"]["numerics"] == "llama.cpp/cpu/gguf-q8_0"
    assert report["paths"]["torch"]["numerics"].endswith("/gguf-q8_0")
    for sub in report["paths"].values():
        assert set(sub["mesh_tok_s"]) == {"1", "2"} and all(v > 0 for v in sub["mesh_tok_s"].values())
        assert sub["split_identical"] is True
        assert [len(sub["peer_rss_mb"][k]) for k in ("1", "2")] == [1, 2]
    assert report["paths"]["llama.cpp"]["tokens_identical"] is True  # llama.cpp ranges = llama.cpp whole
    assert 0.5 <= report["top1_agreement"] <= 1.0 and report["top1_agreement_steps"] == 256
    assert "top-1 agreement" in run.stdout


@pytest.mark.slow
def test_bench_on_a_shaped_link_reports_what_the_shaper_delivered_next_to_the_meshes(tmp_path, tiny_model):
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl_main", "bench", "--model", str(tiny_model), "--peers", "2",
         "--concurrency", "1", "--prompt-tokens", "16", "--new-tokens", "8", "--runs", "1", "--link", "5ms/100Mbit",
         "--speculative", "off,ngram", "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [k for k in TOP_LEVEL if k not in report] == []  # the loopback run keeps the top level
    link = report["links"]["5ms/100Mbit"]
    assert link["shape"] == {"name": "5ms/100Mbit", "spec": "5ms/100Mbit", "delay_ms": 5, "jitter_ms": 0,
                             "jitter": "uniform", "rate_mbit": 100}
    shaper = link["shaper"]
    assert shaper["set_delay_ms"] == 5 and shaper["set_rate_mbit"] == 100 and shaper["set_jitter_ms"] == 0
    assert 5 <= shaper["measured_delay_ms_p50"] <= shaper["measured_delay_ms_p95"] <= 5 + 50
    assert shaper["measured_rate_mbit"] > 0 and shaper["measured_jitter_ms"] >= 0
    plain, guessing = link["meshes"]
    assert plain["setup"] == {"link": "5ms/100Mbit", "speculative": "off"}
    assert guessing["setup"] == {"link": "5ms/100Mbit", "speculative": "ngram"}
    for variant in (plain, guessing):
        assert set(variant["mesh_tok_s"]) == {"2"} and variant["mesh_tok_s"]["2"] > 0
        assert variant["tokens_identical"] is True and variant["split_identical"] is True
        assert variant["seam_ms"]["2"]["p50"] >= 5  # the hidden state crossed the shaped link
        assert len(variant["route"]["2"]["peers"]) == 2 and variant["route"]["2"]["cost_ms"] > 0
    assert plain["tokens_per_step"]["2"] == 1.0 and plain["speculation"]["2"]["sources"] == {}
    assert guessing["tokens_per_step"]["2"] >= 1.0 and guessing["speculation"]["2"]["mode"] == "ngram"
    assert [v["setup"] for v in report["loopback"]["meshes"]] == [{"link": "loopback", "speculative": "off"},
                                                                 {"link": "loopback", "speculative": "ngram"}]
    assert report["speculative"] == "off"  # the top level is the first mode's loopback run
    for place in ("loopback", "5ms/100Mbit"):
        assert report["speculative_speedup"][place]["ngram"]["2"] > 0
    assert "on shaped links" in run.stdout and "speculative ngram" in run.stdout


@pytest.mark.slow
def test_the_prefix_bench_on_tiny_model_reports_reuse_and_an_import_with_identical_replies(tmp_path, tiny_model):
    out = tmp_path / "prefix.json"
    run = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl_main", "bench", "--prefix", "--model", str(tiny_model),
         "--prefix-tokens", "300", "--prefix-conversations", "1", "--prefix-new-tokens", "4", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "prefix" and report["peers"] == 3
    (row,) = report["conversations"]
    assert row["first_prompt_tokens"] >= 256 and row["second_prompt_tokens"] > row["first_prompt_tokens"]
    for key in ("whole_prefill_ttft_ms", "reused_ttft_ms", "one_process_ttft_ms", "speedup"):
        assert row[key] > 0, key
    assert report["identical"] and report["identical_to_one_process"]
    assert report["entry_prefix_reuse"]["reused"] == 1
    assert all(hop["hits"] == 1 for hop in report["hops_prefix_kv"])
    lost = report["lost_cache"]
    assert lost["imported"] == 1 and lost["identical_to_whole_prefill"] and lost["import_speedup"] > 0
    assert "prefix imported from the KV tier" in run.stdout


@pytest.mark.slow
def test_the_prefill_workers_bench_on_tiny_model_reports_both_rounds_with_identical_replies(tmp_path, tiny_model):
    out = tmp_path / "workers.json"
    run = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl_main", "bench", "--prefill-workers", "--model", str(tiny_model),
         "--workers-prompt-tokens", "300", "--workers-busy-tokens", "200", "--workers-new-tokens", "4",
         "--workers-repeats", "1", "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    report = json.loads(out.read_text())
    # whether the tiny model's prefill is worth moving is the cost model's call; the bench says which it made
    used = [row["workers_used"] for row in report["rounds"] if row["prefill_on"] == "workers"]
    assert run.returncode == (0 if any(used) else 1), run.stdout + run.stderr
    if not any(used):
        assert "never prefilled on workers" in run.stderr
    assert report["benchmark"] == "prefill-workers" and report["peers"] == 3 and report["identical"]
    assert [row["prefill_on"] for row in report["rounds"]] == ["route", "workers"]
    for row in report["rounds"]:
        assert row["ttft_ms"] > 0 and row["one_process_ttft_ms"] > 0 and row["identical_to_one_process"]
        assert row["busy"]["tok_s_before"] and row["busy"]["ran_throughout"], row["busy"]
    assert report["rounds"][0]["estimate"] is None  # the entry without workers weighs none
    stalls = report["route_hops_stall"]
    assert len(stalls) == 3 and all(hop["prefill_chunks"] >= 1 and hop["decode_stall_bound_ms"] > 0 for hop in stalls)
    workers_round = report["rounds"][1]
    assert workers_round["estimate"] is not None, "the busy route and its idle replicas were not weighed"
    assert workers_round["estimate"]["chosen"] == bool(workers_round["workers_used"])
    assert "time to first token on workers / on the route" in run.stdout
