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

The relay runs without a bandwidth cap here: the figures are the cost of the relay path itself.
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
from pathlib import Path

import trio

from meshd import __version__
from meshd.daemon.local_mesh import LocalMesh
from meshd.identity import Identity
from meshd.transport import Transport
from meshd.transport.relay import RelayRegistration, relay_address

ECHO_PATH = "/bench/echo"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(samples_ms: list[float]) -> dict:
    return {"n": len(samples_ms), "p50_ms": round(_percentile(samples_ms, 50), 3),
            "p95_ms": round(_percentile(samples_ms, 95), 3), "mean_ms": round(statistics.fmean(samples_ms), 3),
            "min_ms": round(min(samples_ms), 3)}


# -- the echo peer (a child process) ---------------------------------------------------------------


async def _echo(stream) -> None:
    async for message in stream:
        await stream.send_message(message)
    await stream.end()


async def _serve_echo(relay: str, ready: Path) -> None:
    async with Transport(Identity.generate()) as transport, trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve, "127.0.0.1", 0, _echo)

        async def on_circuit(stream, remote: str) -> None:
            await transport.accept_stream(stream, _echo, remote)

        registration = RelayRegistration(transport.identity, relay, on_circuit)
        nursery.start_soon(registration.run)
        while not registration.registered:
            await trio.sleep(0.02)
        ready.write_text(json.dumps({"peer_id": transport.identity.peer_id, "port": port}))
        await trio.sleep_forever()


# -- the measuring side ----------------------------------------------------------------------------


async def _measure(peer_id: str, direct: tuple[str, int], relayed: str, sizes: dict[str, int],
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


def seam_latency(workdir: Path, hidden_size: int, chunk_tokens: int, samples: int, say) -> dict:
    sizes = {"decode_step": hidden_size * 4, "prefill_chunk": chunk_tokens * hidden_size * 4}
    with LocalMesh(workdir, log_level="warning") as mesh:
        relay = mesh.start_relay(extra=["--bandwidth", "0"])  # the relay's cost, not an operator's cap
        ready = workdir / "echo.json"
        log = (workdir / "echo.log").open("ab")
        echo = subprocess.Popen([sys.executable, "-m", "meshd.bench.relay", "--serve-echo", relay.address,
                                 "--ready", str(ready)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if echo.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"echo peer did not start; see {workdir / 'echo.log'}")
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            say(f"seam latency: {samples} samples per link and size, sizes {sizes}")
            result = trio.run(_measure, info["peer_id"], ("127.0.0.1", info["port"]),
                              relay_address(relay.address), sizes, samples)
            result["relay_metrics"] = {k: v for k, v in relay.metrics().items()
                                       if k.startswith(("meshd_relay_bytes", "meshd_relay_circuits_total"))}
        finally:
            echo.terminate()
            echo.wait(timeout=10)
            log.close()
    return result


def decode_speed(workdir: Path, model: str, new_tokens: int, runs: int, say) -> dict:
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


def run(args: argparse.Namespace, say) -> dict:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="meshd-bench-relay-"))
    report: dict = {
        "meta": {"meshd_version": __version__, "python": platform.python_version(), "platform": platform.platform(),
                 "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                 "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
        "seam": seam_latency(workdir / "seam", args.hidden_size, args.chunk_tokens, args.samples, say),
    }
    if args.decode:
        report["decode"] = decode_speed(workdir / "decode", args.model, args.new_tokens, args.runs, say)
    return report


def format_summary(report: dict) -> str:
    lines = ["link     size           p50 ms   p95 ms   mean ms"]
    for link in ("direct", "relayed"):
        for label, row in report["seam"][link].items():
            lines.append(f"{link:<8} {label:<14} {row['p50_ms']:>7.3f}  {row['p95_ms']:>7.3f}  {row['mean_ms']:>8.3f}")
    if "decode" in report:
        d = report["decode"]
        lines.append(f"decode tok/s ({d['model']}, 2 peers): direct {d['direct']['median_decode_tok_s']}, "
                     f"tail relayed {d['relayed']['median_decode_tok_s']}, identical={d['identical']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=200, metavar="N", help="round trips per link and size")
    parser.add_argument("--hidden-size", type=int, default=1024, metavar="N",
                        help="hidden size for the message sizes (default 1024, the bench model's)")
    parser.add_argument("--chunk-tokens", type=int, default=128, metavar="N", help="prefill chunk in tokens")
    parser.add_argument("--decode", action="store_true",
                        help="also measure decode tok/s of --model on 2 peers, tail direct vs relayed")
    parser.add_argument("--model", default="bench", metavar="NAME|DIR", help="model for --decode (default bench)")
    parser.add_argument("--new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--runs", type=int, default=3, metavar="N")
    parser.add_argument("--workdir", metavar="DIR", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--out", default="bench-out/bench-relay.json", metavar="FILE", help="JSON report")


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
