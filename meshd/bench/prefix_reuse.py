"""``meshctl bench --prefix``: how much sooner a conversation's next turn starts when the route's hops
kept the prefix of the last one, with the reply unchanged.

One mesh of k peers holds the model's layers. Two more peers, holding none, are entries into it: one
reuses prefixes (the default), the other runs with ``--no-prefix-reuse``; both cut prefills at the
same places, so their replies must be bit for bit alike. For each of a few conversations, the first
turn (a long system prompt and a question) goes through the reusing entry; then the second turn
(the first, its reply and a follow-up) goes through the other entry (a whole prefill) and then through
the reusing one (which starts after the kept prefix). Times to first token come from streamed chat
completions; the reply's tokens are compared between the two entries and with one process running
transformers ``generate()`` on the same prompt.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from meshd.daemon.local_mesh import LocalMesh

FOLLOW_UP = "Now say the same again in fewer words, and name the river."
TIER_SIZE = "2GiB"
QUESTIONS = ("Which bridge is the oldest?", "What is the weather like in the harbor?",
             "Where does the river meet the sea?", "Which market opens first in the morning?")


@dataclass(frozen=True)
class PrefixBenchConfig:
    model: str = "bench"
    peers: int = 3
    first_tokens: int = 1024   # the first turn's prompt, about
    conversations: int = 3
    new_tokens: int = 32
    dtype: str = "auto"
    workdir: Path | None = None


@dataclass(frozen=True)
class ChatTiming:
    tokens: list[str]
    text: str
    ttft_ms: float


def stream_chat(client: Any, model: str, messages: list[dict], max_tokens: int) -> ChatTiming:
    """A greedy streamed chat completion of exactly ``max_tokens`` tokens (``ignore_eos``), with each
    token as the API names it (log-probability entries) and the time to the first one."""
    started = time.perf_counter()
    first: float | None = None
    tokens: list[str] = []
    text: list[str] = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, logprobs=True, extra_body={"ignore_eos": True}):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        entries = choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else []
        if entries and first is None:
            first = time.perf_counter() - started
        tokens += [e.token for e in entries]
        text.append(choice.delta.content or "")
    if first is None or len(tokens) != max_tokens:
        raise BenchError(f"the streamed chat completion carried {len(tokens)} tokens, not {max_tokens}")
    return ChatTiming(tokens, "".join(text), first * 1000)


def first_turn(tokenizer: Any, target_tokens: int, index: int) -> list[dict]:
    """Conversation ``index``'s first turn: a system prompt of about ``target_tokens`` tokens (each
    conversation's another cut of the seed text) and a question."""
    system = build_prompt(tokenizer, max(16, target_tokens - 32), start=index * 997).text
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]


def run_prefix_bench(cfg: PrefixBenchConfig, say: Say) -> dict:
    import torch

    from meshd.bench.baseline import Baseline
    from meshd.models.text import TextCodec

    quiet_transformers()
    if cfg.conversations < 1 or cfg.first_tokens < 64 or cfg.new_tokens < 1:
        raise BenchError("the prefix benchmark needs a conversation, a first turn of 64 tokens or more, and a token")
    model_dir, n_layers = splittable_model(cfg.model, (cfg.peers,), say)
    model_id = model_dir.name
    codec = TextCodec.load(model_dir)
    if not codec.has_chat_template:
        raise BenchError(f"{model_id} has no chat template: the prefix benchmark sends chats")
    threads = torch.get_num_threads()
    load_start = os.getloadavg()[0]
    ranges = even_ranges(n_layers, cfg.peers)
    env = {"MESHD_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    conversations: list[dict[str, Any]] = []
    seconds: list[tuple[list[dict], list[str]]] = []  # each second turn, and its reply after the kept prefix
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="meshd-bench-prefix-"))
    dtype_flags = ["--dtype", cfg.dtype]
    with LocalMesh(workdir, log_level="warning", env=env) as mesh:
        say(f"mesh of {cfg.peers}: layers {', '.join(f'[{s},{e})' for s, e in ranges)}, and two entries without "
            "layers: one reusing prefixes, one not")
        hops = mesh.start_peers([{"model": model_dir, "layers": r, "extra": dtype_flags} for r in ranges],
                                timeout=PEER_START_TIMEOUT_S)
        reusing, whole, tier = mesh.start_peers([{"extra": []}, {"extra": ["--no-prefix-reuse"]},
                                                 {"extra": ["--kv-tier", TIER_SIZE]}], timeout=PEER_START_TIMEOUT_S)
        mesh.wait_covered(model_id, timeout=COVER_TIMEOUT_S)
        from openai import OpenAI

        clients = {name: OpenAI(base_url=f"http://{peer.api}/v1", api_key="meshd", timeout=REQUEST_TIMEOUT_S,
                                max_retries=0) for name, peer in (("reuse", reusing), ("whole", whole))}
        for name, client in clients.items():  # warm-up: connections, routes, tokenizers, speed checks
            stream_chat(client, model_id, [{"role": "user", "content": f"warm up {name}"}], 2)
        wait_for_speed_checks(reusing, say)
        wait_for_speed_checks(whole, say)
        for i in range(cfg.conversations):
            messages = first_turn(codec.tokenizer, cfg.first_tokens, i)
            one = stream_chat(clients["reuse"], model_id, messages, cfg.new_tokens)
            second = [*messages, {"role": "assistant", "content": one.text}, {"role": "user", "content": FOLLOW_UP}]
            full = stream_chat(clients["whole"], model_id, second, cfg.new_tokens)
            reused = stream_chat(clients["reuse"], model_id, second, cfg.new_tokens)
            row = {"first_prompt_tokens": len(codec.encode_chat(messages)),
                   "second_prompt_tokens": len(codec.encode_chat(second)),
                   "first_turn_ttft_ms": round(one.ttft_ms, 1), "whole_prefill_ttft_ms": round(full.ttft_ms, 1),
                   "reused_ttft_ms": round(reused.ttft_ms, 1), "speedup": round(full.ttft_ms / reused.ttft_ms, 2),
                   "identical_to_whole_prefill": reused.tokens == full.tokens}
            conversations.append(row)
            seconds.append((second, reused.tokens))
            say(f"conversation {i + 1}: second turn of {row['second_prompt_tokens']} tokens: first token after "
                f"{full.ttft_ms:.0f} ms with a whole prefill, {reused.ttft_ms:.0f} ms after the kept prefix "
                f"({row['speedup']:.2f}x), {'identical' if row['identical_to_whole_prefill'] else 'DIFFERENT'}")
        entry_stats = reusing.get("/stats")["prefix_reuse"]
        hop_stats = [hop.get("/stats")["prefix_kv"] for hop in sorted(hops, key=lambda p: p.get("/status")["range"][0])]
        numerics = hops[0].get("/status")["numerics"]
        lost = _lost_cache(mesh, sorted(hops, key=lambda p: p.get("/status")["range"][0]), clients, tier, codec,
                           cfg, model_dir, model_id, dtype_flags, say)
    say(f"one process: {model_id} with transformers generate(), {threads} torch threads")
    base: Baseline | None = None
    for row, (second, tokens) in zip(conversations, seconds, strict=True):
        ids = codec.encode_chat(second)
        if base is None:
            base = Baseline(model_dir, ids, cfg.new_tokens, dtype=_dtype(cfg.dtype, model_dir))
        base.prompt_ids, base.token_ids = ids, None
        measured = base.measure(1)
        row["one_process_ttft_ms"] = round(measured.ttft_ms, 1)
        row["identical_to_one_process"] = tokens == [codec.token_text(t) for t in measured.token_ids]
    speedups = [row["speedup"] for row in conversations]
    return {
        "benchmark": "prefix", "model": model_id, "peers": cfg.peers, "ranges": [list(r) for r in ranges],
        "numerics": numerics, "new_tokens": cfg.new_tokens, "conversations": conversations,
        "speedup_median": statistics.median(speedups), "speedup_min": min(speedups),
        "identical": all(r["identical_to_whole_prefill"] for r in conversations),
        "identical_to_one_process": all(r["identical_to_one_process"] for r in conversations),
        "lost_cache": lost, "entry_prefix_reuse": entry_stats, "hops_prefix_kv": hop_stats,
        "machine": machine_meta(threads, load_start),
    }


def _lost_cache(mesh: LocalMesh, hops: list[Any], clients: dict[str, Any], tier: Any, codec: Any,
                cfg: PrefixBenchConfig, model_dir: Path, model_id: str, flags: list[str], say: Say) -> dict[str, Any]:
    """Another conversation's first turn; then the middle hop restarts without its prefixes, and the
    second turn goes through a whole prefill and then through the reusing entry, whose route's
    restarted hop imports the prefix from the KV tier."""
    messages = first_turn(codec.tokenizer, cfg.first_tokens, cfg.conversations)
    one = stream_chat(clients["reuse"], model_id, messages, cfg.new_tokens)
    def published() -> bool:
        stats = [hop.get("/stats") for hop in hops]
        return all(s["kv_tier"]["published"] + s["kv_tier"]["publish_failed"] >= s["prefix_kv"]["kept"]
                   for s in stats)

    mesh.wait_until(published, COVER_TIMEOUT_S, "every hop's prefixes in the KV tier")
    middle = hops[len(hops) // 2]
    start, end = middle.get("/status")["range"]
    say(f"KV tier: restarting the hop of layers [{start},{end}), which loses its prefixes")
    mesh.kill(middle, signal.SIGKILL)
    middle.process.wait(timeout=30)
    restarted = mesh.start_peer(model=model_dir, layers=(start, end), extra=flags, data_dir=middle.data_dir,
                                timeout=PEER_START_TIMEOUT_S)
    mesh.wait_covered(model_id, timeout=COVER_TIMEOUT_S)
    for name, client in clients.items():  # the restarted hop's first calls, and the entries' new speed checks
        stream_chat(client, model_id, [{"role": "user", "content": f"warm up {name} again"}], 2)
    second = [*messages, {"role": "assistant", "content": one.text}, {"role": "user", "content": FOLLOW_UP}]
    full = stream_chat(clients["whole"], model_id, second, cfg.new_tokens)
    imported = stream_chat(clients["reuse"], model_id, second, cfg.new_tokens)
    stats = restarted.get("/stats")
    row = {"second_prompt_tokens": len(codec.encode_chat(second)), "restarted_hop": [start, end],
           "whole_prefill_ttft_ms": round(full.ttft_ms, 1), "imported_ttft_ms": round(imported.ttft_ms, 1),
           "import_speedup": round(full.ttft_ms / imported.ttft_ms, 2),
           "imported": stats["kv_tier"]["imported"], "identical_to_whole_prefill": imported.tokens == full.tokens,
           "tier": tier.get("/stats")["kv_tier"]["lent"]}
    say(f"KV tier: second turn after the restart: {full.ttft_ms:.0f} ms with a whole prefill, "
        f"{imported.ttft_ms:.0f} ms with the prefix imported ({row['import_speedup']:.2f}x, "
        f"{row['imported']} imported), {'identical' if row['identical_to_whole_prefill'] else 'DIFFERENT'}")
    return row


def _dtype(requested: str, model_dir: Path) -> Any:
    from meshd.runtime.shard import resolve_dtype

    return resolve_dtype(requested, model_dir)


def format_prefix_summary(report: dict) -> str:
    lines = [f"prefix reuse, {report['model']} on {report['peers']} peers ({report['numerics']})",
             f"{'turn 2 tokens':>14} {'whole prefill ms':>17} {'after prefix ms':>16} {'speedup':>8} "
             f"{'one process ms':>15} {'identical':>10}"]
    for row in report["conversations"]:
        same = "yes" if row["identical_to_whole_prefill"] and row["identical_to_one_process"] else "NO"
        lines.append(f"{row['second_prompt_tokens']:>14} {row['whole_prefill_ttft_ms']:>17.1f} "
                     f"{row['reused_ttft_ms']:>16.1f} {row['speedup']:>7.2f}x {row['one_process_ttft_ms']:>15.1f} "
                     f"{same:>10}")
    lines.append(f"median speedup {report['speedup_median']:.2f}x (least {report['speedup_min']:.2f}x)")
    lost = report["lost_cache"]
    same = "identical" if lost["identical_to_whole_prefill"] else "DIFFERENT"
    lines.append(f"hop [{lost['restarted_hop'][0]},{lost['restarted_hop'][1]}) restarted: whole prefill "
                 f"{lost['whole_prefill_ttft_ms']:.1f} ms, prefix imported from the KV tier "
                 f"{lost['imported_ttft_ms']:.1f} ms ({lost['import_speedup']:.2f}x), {same}")
    return "\n".join(lines)


def main_prefix(cfg: PrefixBenchConfig, out: Path) -> int:
    """``meshctl bench --prefix``: run, write the JSON, print the table; 1 if a reply changed."""
    report = written_report(lambda say: run_prefix_bench(cfg, say), out, format_prefix_summary)
    if report is None:
        return 1
    if not report["identical"] or not report["lost_cache"]["identical_to_whole_prefill"]:
        print("meshctl bench: a reply after a kept prefix differs from the whole prefill's", file=sys.stderr)
        return 1
    return 0
