"""``meshctl bench-relay``: seam latency through a relay against a direct link, in the same run.

Three processes on loopback: a ``meshd-relay``, an echo peer (a ``Transport`` that listens on TCP
*and* is registered with the relay), and this process, which dials the echo peer both ways over
the real transport (TLS 1.3 + client auth + HTTP/2; through the relay, inside WebSockets). On one
long-lived stream per link, like a seam, it sends a message and waits for the echo, alternating
direct and relayed samples so that both see the same machine load. Two sizes: one decode step's
hidden state (``hidden_size`` float32) and one prefill chunk (``chunk_tokens`` x that).

With ``--decode`` it also serves the ``bench`` model from two local peers with even pinned
ranges, once with both direct and once with the tail reachable only through the relay, and reports
decode tokens/s of each and whether their outputs are identical.

The relay runs without a bandwidth cap there: the figures are the cost of the relay path itself.

With ``--compression`` it also measures what zstd over byte planes does to one prefill chunk on
links of different speeds: direct, relayed without a cap, and relayed through relays capped at
``--link-caps`` (as an operator's cap, or a slow uplink, would). Each sample is the whole cost of
one chunk: encoding (compressed or not), sending it until the receiver acknowledged it, and
decoding it; alongside, the decision the per-link policy takes from the same measurements.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from meshd import __version__
from meshd.address import Address, relay_address
from meshd.daemon.local_mesh import LocalMesh, LocalMeshError, log_tail, wait_for_ready_file
from meshd.files import write_atomically
from meshd.identity import Identity
from meshd.stats import percentiles
from meshd.transport import MessageStream, Transport
from meshd.transport.relay import RelayRegistration
from meshd.transport.websocket import WebSocketStream
from meshd.wire.bundle import HiddenStateBundle

Say = Callable[[str], None]
ECHO_PATH = "/bench/echo"
ACK_PATH = "/bench/ack"


def summarize(samples_ms: list[float]) -> dict:
    figures = percentiles(samples_ms)
    return {"n": figures["count"], "p50_ms": round(figures["p50"], 3), "p95_ms": round(figures["p95"], 3),
            "mean_ms": round(figures["mean"], 3), "min_ms": round(min(samples_ms), 3)}


# -- the echo peer (a child process) ---------------------------------------------------------------


async def _echo(stream: MessageStream) -> None:
    while (message := await stream.receive_message()) is not None:
        await stream.send_message(message)
    await stream.end()


async def _ack(stream: MessageStream) -> None:
    while await stream.receive_message() is not None:
        await stream.send_message(b"k")
    await stream.end()


async def _serve(stream: MessageStream) -> None:
    await (_ack if stream.path == ACK_PATH else _echo)(stream)


async def _serve_echo(relay: str, ready: Path) -> None:
    async with Transport(Identity.generate()) as transport, trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve, "127.0.0.1:0", _serve)

        async def on_circuit(stream: WebSocketStream, remote: str) -> None:
            await transport.accept_stream(stream, _serve, remote)

        registration = RelayRegistration(transport.identity, relay, on_circuit)
        nursery.start_soon(registration.run)
        while not registration.registered:
            await trio.sleep(0.02)
        write_atomically(ready, json.dumps({"peer_id": transport.identity.peer_id, "port": port}))
        await trio.sleep_forever()


# -- the measuring side ----------------------------------------------------------------------------


async def _measure(peer_id: str, direct: Address, relayed: Address, sizes: dict[str, int],
                   samples: int) -> dict:
    out: dict[str, dict] = {"direct": {}, "relayed": {}}
    async with Transport(Identity.generate()) as direct_side, Transport(Identity.generate()) as relayed_side:
        links = {"direct": await direct_side.open_stream(peer_id, direct, ECHO_PATH),
                 "relayed": await relayed_side.open_stream(peer_id, relayed, ECHO_PATH)}
        assert relayed_side.connection_route(peer_id) == "relay"
        for label, size in sizes.items():
            payload = os.urandom(size)
            times: dict[str, list[float]] = {"direct": [], "relayed": []}
            for i in range(samples + 5):
                for name in ("direct", "relayed") if i % 2 == 0 else ("relayed", "direct"):
                    stream = links[name]
                    started = time.perf_counter()
                    await stream.send_message(payload)
                    echoed = await stream.receive_message()
                    elapsed = (time.perf_counter() - started) * 1000
                    if echoed != payload:
                        raise RuntimeError(f"{name} echo came back different")
                    if i >= 5:  # the first few warm up windows and buffers
                        times[name].append(elapsed)
            for name in times:
                out[name][label] = {"bytes": size, **summarize(times[name])}
        for stream in links.values():
            await stream.aclose()
    return out


class _EchoPeer:
    """The echo peer child process, registered with ``relay``, for as long as the ``with`` lasts."""

    def __init__(self, workdir: Path, relay: str) -> None:
        self.workdir, self.relay = workdir, relay

    def __enter__(self) -> dict:
        ready = self.workdir / "echo.json"
        ready.unlink(missing_ok=True)
        self.log = (self.workdir / "echo.log").open("ab")
        self.process = subprocess.Popen([sys.executable, "-m", "meshd.bench.relay", "--serve-echo", self.relay,
                                         "--ready", str(ready)], stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        try:
            return wait_for_ready_file(ready, self.process, 30, "the echo peer",
                                       lambda: log_tail(self.workdir / "echo.log"))
        except LocalMeshError:
            self.__exit__()
            raise

    def __exit__(self, *_exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


def seam_latency(workdir: Path, hidden_size: int, chunk_tokens: int, samples: int, say: Say) -> dict[str, Any]:
    sizes = {"decode_step": hidden_size * 4, "prefill_chunk": chunk_tokens * hidden_size * 4}
    with LocalMesh(workdir, log_level="warning") as mesh:
        relay = mesh.start_relay(extra=["--bandwidth", "0"])  # the relay's cost, not an operator's cap
        with _EchoPeer(workdir, relay.address) as info:
            say(f"seam latency: {samples} samples per link and size, sizes {sizes}")
            result = trio.run(_measure, info["peer_id"], Address("127.0.0.1", info["port"]),
                              relay_address(relay.address), sizes, samples)
            result["relay_metrics"] = {k: v for k, v in relay.metrics().items()
                                       if k.startswith(("meshd_relay_bytes", "meshd_relay_circuits_total"))}
    return result


async def _chunk_costs(peer_id: str, address: Address, chunk: HiddenStateBundle, samples: int) -> dict[str, Any]:
    """Encode, send until acknowledged, decode: one prefill chunk, raw and compressed, alternately."""
    from meshd.session import messages as m
    from meshd.session.link_compression import CompressionPolicy
    from meshd.wire import bundle as wire

    raw_bytes = wire.raw_tensor_bytes(chunk)
    policy = CompressionPolicy()
    times: dict[str, list[float]] = {"raw": [], "zstd": []}
    wire_bytes: dict[str, int] = {}
    async with Transport(Identity.generate()) as side:
        stream = await side.open_stream(peer_id, address, ACK_PATH)
        policy.window_bytes = side.config.stream_window
        for i in range(samples + 2):
            for kind in ("raw", "zstd") if i % 2 == 0 else ("zstd", "raw"):
                started = time.perf_counter()
                data = m.bundle_msg(wire.encode(chunk, compress=kind == "zstd"))
                encoded = time.perf_counter()
                await stream.send_message(data)
                sent = time.perf_counter()  # what the hop times for its policy: the send alone
                if await stream.receive_message() != b"k":
                    raise RuntimeError("the receiver did not acknowledge the chunk")
                wire.decode(m.parse(data).bundle)
                done = time.perf_counter()
                if i < 2:
                    continue  # warm-up
                wire_bytes[kind] = len(data)
                times[kind].append((done - started) * 1000)
                policy.record_send(len(data), sent - encoded)
                if kind == "zstd":
                    policy.record_compression(raw_bytes, len(data), encoded - started)
        await stream.aclose()
    raw_ms, zstd_ms = statistics.median(times["raw"]), statistics.median(times["zstd"])
    return {"raw": {"bytes": wire_bytes["raw"], **summarize(times["raw"])},
            "zstd": {"bytes": wire_bytes["zstd"], **summarize(times["zstd"])},
            "zstd_saves_time": zstd_ms < raw_ms, "zstd_time_ratio": round(zstd_ms / raw_ms, 3),
            "policy_compresses": policy.should_compress(raw_bytes),
            "policy_link_mb_s": round((policy.link_bytes_per_s or 0) / 1e6, 1)}


def compression_tradeoff(workdir: Path, hidden_size: int, chunk_tokens: int, caps: list[str], samples: int,
                         say: Say) -> dict[str, Any]:
    import torch

    from meshd.wire.bundle import HiddenStateBundle, Phase

    # Hidden states of the bench model and normal noise of the same scale compress alike (both to
    # about 84% of their bytes); noise needs no model loaded.
    tensor = torch.randn(chunk_tokens, hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    chunk = HiddenStateBundle(session_id="bench", epoch=0, phase=Phase.PREFILL, start_position=0,
                              token_count=chunk_tokens, tensors={"hidden_states": tensor}, range_start=0,
                              range_end=1)
    out: dict = {"chunk_bytes": tensor.numel() * 4, "samples": samples}
    for cap in ["0", *caps]:
        label = "relayed" if cap == "0" else f"relayed, capped at {cap}/s"
        with LocalMesh(workdir / f"cap-{cap}", log_level="warning") as mesh:
            burst = ["--bandwidth-burst", "256KiB"] if cap != "0" else []  # a burst shapes a cap only
            relay = mesh.start_relay(extra=["--bandwidth", cap, *burst])
            with _EchoPeer(workdir / f"cap-{cap}", relay.address) as info:
                links = {label: relay_address(relay.address)}
                if cap == "0":
                    links = {"direct": Address("127.0.0.1", info["port"]), **links}
                for name, address in links.items():
                    out[name] = trio.run(_chunk_costs, info["peer_id"], address, chunk, samples)
                    say(f"compression, {name}: raw {out[name]['raw']['p50_ms']} ms, zstd "
                        f"{out[name]['zstd']['p50_ms']} ms; the policy "
                        f"{'compresses' if out[name]['policy_compresses'] else 'sends raw'}")
    return out


def decode_speed(workdir: Path, model: str, new_tokens: int, runs: int, say: Say) -> dict[str, Any]:
    from openai import OpenAI
    from transformers import AutoConfig, AutoTokenizer

    from meshd.bench.runner import resolve_model
    from meshd.bench.workload import build_prompt, stream_completion
    from meshd.cli.demo import even_ranges

    model_dir = resolve_model(model, say)
    n_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    prompt = build_prompt(AutoTokenizer.from_pretrained(model_dir), 32)
    ranges = even_ranges(n_layers, 2)
    result: dict = {"model": model_dir.name, "ranges": ranges, "new_tokens": new_tokens, "runs": runs}
    texts = {}
    for label in ("direct", "relayed"):
        with LocalMesh(workdir / label, log_level="warning", env={"OMP_NUM_THREADS": "1"}) as mesh:
            tail_extra = []
            if label == "relayed":
                relay = mesh.start_relay(extra=["--bandwidth", "0"])
                tail_extra = ["--reachability", "relayed", "--relay", relay.address]
            head = mesh.start_peer(model=model_dir, layers=ranges[0], timeout=180)
            mesh.start_peer(model=model_dir, layers=ranges[1], extra=tail_extra, timeout=180)
            mesh.wait_covered(model_dir.name, timeout=120)
            client = OpenAI(base_url=f"http://{head.api}/v1", api_key="meshd", timeout=600, max_retries=0)
            stream_completion(client, model_dir.name, prompt.text, 4)  # warm-up
            timings = [stream_completion(client, model_dir.name, prompt.text, new_tokens) for _ in range(runs)]
            texts[label] = {t.text for t in timings}
            result[label] = {"decode_tok_s": [round(t.decode_tok_s, 2) for t in timings],
                             "median_decode_tok_s": round(statistics.median(t.decode_tok_s for t in timings), 2),
                             "ttft_ms": [round(t.ttft_ms, 1) for t in timings]}
            say(f"decode, tail {label}: {result[label]['decode_tok_s']} tok/s")
    result["identical"] = len(texts["direct"] | texts["relayed"]) == 1
    return result


def run(args: argparse.Namespace, say: Say) -> dict[str, Any]:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="meshd-bench-relay-"))
    report: dict = {
        "meta": {"meshd_version": __version__, "python": platform.python_version(), "platform": platform.platform(),
                 "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                 "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
        "seam": seam_latency(workdir / "seam", args.hidden_size, args.chunk_tokens, args.samples, say),
    }
    if args.compression:
        caps = [c.strip() for c in args.link_caps.split(",") if c.strip()]
        report["compression"] = compression_tradeoff(workdir / "compression", args.hidden_size,
                                                     args.compression_tokens, caps, args.compression_samples, say)
    if args.decode:
        report["decode"] = decode_speed(workdir / "decode", args.model, args.new_tokens, args.runs, say)
    return report


def format_summary(report: dict) -> str:
    lines = ["link     size           p50 ms   p95 ms   mean ms"]
    for link in ("direct", "relayed"):
        for label, row in report["seam"][link].items():
            lines.append(f"{link:<8} {label:<14} {row['p50_ms']:>7.3f}  {row['p95_ms']:>7.3f}  {row['mean_ms']:>8.3f}")
    if "compression" in report:
        c = report["compression"]
        lines += ["", f"one prefill chunk of {c['chunk_bytes']} bytes: encode + send + decode, p50 ms",
                  "link                              raw      zstd   zstd/raw  policy"]
        for name, row in c.items():
            if isinstance(row, dict):
                lines.append(f"{name:<30} {row['raw']['p50_ms']:>8.2f}  {row['zstd']['p50_ms']:>8.2f}  "
                             f"{row['zstd_time_ratio']:>8.3f}  {'zstd' if row['policy_compresses'] else 'raw'}")
    if "decode" in report:
        d = report["decode"]
        lines.append(f"decode tok/s ({d['model']}, 2 peers): direct {d['direct']['median_decode_tok_s']}, "
                     f"tail relayed {d['relayed']['median_decode_tok_s']}, identical={d['identical']}")
    return "\n".join(lines)


def main_bench_relay(args: argparse.Namespace) -> int:
    def say(message: str) -> None:
        print(f"[bench-relay {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    report = run(args, say)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    say(f"wrote {out}")
    print(format_summary(report))
    return 0 if report.get("decode", {}).get("identical", True) else 1


def _child_main() -> None:
    parser = argparse.ArgumentParser(description="echo peer for meshctl bench-relay (internal)")
    parser.add_argument("--serve-echo", required=True, metavar="RELAY")
    parser.add_argument("--ready", required=True, type=Path)
    args = parser.parse_args()
    trio.run(_serve_echo, args.serve_echo, args.ready)


if __name__ == "__main__":
    _child_main()
