"""``meshctl``: the operator tool."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshd.cli.mesh_cmd import ControlError, add_mesh_parsers
from meshd.cli.mode_options import ModeTable, fill_defaults, misplaced
from meshd.cli.replay_cmd import add_replay_parser
from meshd.cli.service_cmd import add_service_parser
from meshd.cli.sim_cmd import add_sim_parser
from meshd.cli.trace_cmd import add_trace_parser
from meshd.daemon.config import DTYPE_CHOICES
from meshd.links.profiles import LinkShape, LinkShapeError, parse_link_shapes
from meshd.models import BUILTIN_NAMES
from meshd.session import SPECULATIVE_MODES


def _cmd_model_create(args: argparse.Namespace) -> int:
    from meshd.errors import MeshError
    from meshd.models.builtin import create_builtin, default_model_dir

    def say(message: str) -> None:
        print(f"  {message}", file=sys.stderr)

    if args.format == "gguf":
        from meshd.models.gguf_export import create_builtin_gguf

        out = Path(args.out) if args.out else default_model_dir(args.name).with_name(f"{args.name}-{args.quant}.gguf")
        print(f"creating built-in model {args.name!r} as {args.quant} GGUF in {out}", file=sys.stderr)
        try:
            create_builtin_gguf(args.name, out, args.quant, say, force=args.force)
        except (OSError, MeshError) as exc:
            print(f"meshctl: {exc}", file=sys.stderr)
            return 1
        print(out)
        return 0
    if args.quant != "f32":
        print("meshctl: --quant applies to --format gguf", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_model_dir(args.name)
    print(f"creating built-in model {args.name!r} in {out}", file=sys.stderr)
    try:
        create_builtin(args.name, out, progress=say, force=args.force)
    except (OSError, MeshError) as exc:  # exists already, or cannot be written there
        print(f"meshctl: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from meshd.cli.demo import run_demo

    return run_demo(model_dir=Path(args.model) if args.model else None)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(sorted({float(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected numbers above 0, got {text!r}")
    return values


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    wrong = [m for m in modes if m not in SPECULATIVE_MODES]
    if not modes or wrong:
        raise argparse.ArgumentTypeError(f"speculative modes are {', '.join(SPECULATIVE_MODES)}, got {text!r}")
    return modes


def _link_shapes(text: str) -> tuple[LinkShape, ...]:
    try:
        return parse_link_shapes(text)
    except LinkShapeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The options only one of ``meshctl bench``'s benchmarks takes, with their defaults (meshd.cli.mode_options).
BENCH_OPTIONS: ModeTable = {
    "standard": {"--concurrency": ("concurrency", (1, 4, 8)), "--prompt-tokens": ("prompt_tokens", 64),
                 "--new-tokens": ("new_tokens", 128), "--runs": ("runs", 3), "--quant": ("quant", "q8_0"),
                 "--draft-model": ("draft_model", None)},
    "serve": {"--serve-rates": ("serve_rates", None), "--serve-clients": ("serve_clients", (4, 8)),
              "--serve-requests": ("serve_requests", 8),
              "--serve-prompt-tokens": ("serve_prompt_tokens", (32, 64, 128, 256, 512)),
              "--serve-new-tokens": ("serve_new_tokens", (16, 32, 64, 128)),
              "--serve-ttft-bound-s": ("serve_ttft_bound_s", 2.0), "--serve-share": ("serve_share", 0.8),
              "--seed": ("seed", 0)},
    "prefix": {"--prefix-tokens": ("prefix_tokens", 1024), "--prefix-conversations": ("prefix_conversations", 3),
               "--prefix-new-tokens": ("prefix_new_tokens", 32)},
    "prefill-workers": {"--workers-prompt-tokens": ("workers_prompt_tokens", 1536),
                        "--workers-busy-tokens": ("workers_busy_tokens", 256),
                        "--workers-new-tokens": ("workers_new_tokens", 16),
                        "--workers-repeats": ("workers_repeats", 2), "--no-pin": ("workers_pin", True)},
}
_BENCH_NAMES = {"standard": "the standard workload", "serve": "--serve", "prefix": "--prefix",
                "prefill-workers": "--prefill-workers"}


def _bench_options_refused(args: argparse.Namespace, benchmark: str) -> bool:
    """Whether options ``benchmark`` would ignore were given (and said so); otherwise fill in the defaults
    of its own."""
    foreign = [flag for flag, _mode in misplaced(args, BENCH_OPTIONS, {benchmark})]
    if benchmark == "standard" and args.quant is not None and args.format != "gguf":
        foreign.append("--quant without --format gguf")
    elif benchmark == "standard" and args.quant is not None and args.model not in BUILTIN_NAMES:
        foreign.append("--quant with a GGUF file (its own quantization is what is measured)")
    if benchmark == "standard" and args.draft_model is not None and not {"model", "auto"} & set(args.speculative):
        foreign.append("--draft-model without --speculative model or auto")
    if foreign:
        print(f"meshctl bench: {_BENCH_NAMES[benchmark]} does not take {', '.join(foreign)}; "
              "see meshctl bench --help for which options each benchmark takes", file=sys.stderr)
        return True
    fill_defaults(args, BENCH_OPTIONS, {benchmark})
    return False


def _cmd_bench(args: argparse.Namespace) -> int:
    if sum((args.serve, args.prefix, args.prefill_workers)) > 1:
        print("meshctl bench: --serve, --prefix and --prefill-workers are separate benchmarks; run one at a time",
              file=sys.stderr)
        return 2
    benchmark = ("serve" if args.serve else "prefix" if args.prefix
                 else "prefill-workers" if args.prefill_workers else "standard")
    if _bench_options_refused(args, benchmark):
        return 2
    if args.serve:
        return _cmd_bench_serve(args)
    if args.prefix:
        return _cmd_bench_prefix(args)
    if args.prefill_workers:
        return _cmd_bench_workers(args)
    from meshd.bench.runner import BenchConfig, main_bench

    links = {shape.label: shape for shapes in args.link or [] for shape in shapes}
    cfg = BenchConfig(model=args.model, peers=args.peers or (1, 2, 3), concurrency=args.concurrency,
                      prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, runs=args.runs,
                      workdir=Path(args.workdir) if args.workdir else None, dtype=args.dtype, format=args.format,
                      quant=args.quant, links=tuple(links.values()), speculative=args.speculative,
                      draft_model=args.draft_model)
    name = Path(args.model).name + (f"-gguf-{args.quant}" if args.format == "gguf" and args.model in BUILTIN_NAMES
                                    else "")
    out = Path(args.out) if args.out else Path("bench-out") / f"bench-{name}.json"
    return main_bench(cfg, out)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from meshd.bench.serving import PEERS, ServeConfig, main_serve

    if args.format != "safetensors" or args.link or args.speculative != ("off",):
        print("meshctl bench: --serve measures safetensors meshes on loopback without speculation; it does not "
              "take --format gguf, --link or --speculative", file=sys.stderr)
        return 2
    if args.dtype == "int8":
        print("meshctl bench: --serve compares with one transformers process in the checkpoint's dtypes; it does "
              "not take --dtype int8", file=sys.stderr)
        return 2
    cfg = ServeConfig(model=args.model, peers=args.peers or PEERS, clients=args.serve_clients,
                      rates=args.serve_rates or (), requests=args.serve_requests, seed=args.seed,
                      ttft_bound_s=args.serve_ttft_bound_s, share=args.serve_share,
                      prompt_tokens=args.serve_prompt_tokens, new_tokens=args.serve_new_tokens, dtype=args.dtype,
                      workdir=Path(args.workdir) if args.workdir else None)
    out = Path(args.out) if args.out else Path("bench-out") / f"serve-{Path(args.model).name}.json"
    return main_serve(cfg, out)


def _plain_loopback_only(args: argparse.Namespace, benchmark: str) -> bool:
    """Whether ``benchmark`` was asked for with options it does not take (and said so)."""
    if args.format != "safetensors" or args.link or args.speculative != ("off",) or args.dtype == "int8":
        print(f"meshctl bench: {benchmark} measures safetensors meshes on loopback without speculation, in the "
              "checkpoint's dtypes; it does not take --format gguf, --link, --speculative or --dtype int8",
              file=sys.stderr)
        return True
    return False


def _cmd_bench_workers(args: argparse.Namespace) -> int:
    from meshd.bench.prefill_workers import WorkersBenchConfig, main_workers

    if _plain_loopback_only(args, "--prefill-workers"):
        return 2
    cfg = WorkersBenchConfig(model=args.model, peers=max(args.peers or (3,)), prompt_tokens=args.workers_prompt_tokens,
                             busy_tokens=args.workers_busy_tokens, new_tokens=args.workers_new_tokens,
                             repeats=args.workers_repeats, dtype=args.dtype, pin=args.workers_pin,
                             workdir=Path(args.workdir) if args.workdir else None)
    out = Path(args.out) if args.out else Path("bench-out") / f"prefill-workers-{Path(args.model).name}.json"
    return main_workers(cfg, out)


def _cmd_bench_prefix(args: argparse.Namespace) -> int:
    from meshd.bench.prefix_reuse import PrefixBenchConfig, main_prefix

    if _plain_loopback_only(args, "--prefix"):
        return 2
    cfg = PrefixBenchConfig(model=args.model, peers=max(args.peers or (3,)), first_tokens=args.prefix_tokens,
                            conversations=args.prefix_conversations, new_tokens=args.prefix_new_tokens,
                            dtype=args.dtype, workdir=Path(args.workdir) if args.workdir else None)
    out = Path(args.out) if args.out else Path("bench-out") / f"prefix-{Path(args.model).name}.json"
    return main_prefix(cfg, out)


def _cmd_bench_relay(args: argparse.Namespace) -> int:
    from meshd.bench.relay import main_bench_relay
    from meshd.bench.relay_cli import options_refused

    wrong = options_refused(args)
    if wrong is not None:
        print(f"meshctl bench-relay: {wrong}", file=sys.stderr)
        return 2
    return main_bench_relay(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Check a model directory's range as a peer would before serving it (no daemon needed)."""
    from meshd.daemon.config import parse_range
    from meshd.runtime.devices import resolve_device
    from meshd.runtime.doctor import run_doctor

    try:
        layers = parse_range(args.layers) if args.layers else None
        resolve_device(args.device)  # a device this machine lacks is a bad argument, not a failed check
    except ValueError as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return 2
    model = Path(args.model)
    if not (model.is_dir() or (model.is_file() and model.suffix.lower() == ".gguf")):
        print(f"meshctl: {model} is neither a model directory nor a GGUF file", file=sys.stderr)
        return 2
    report = run_doctor(model, layers, args.dtype, args.device, backend=args.backend,
                        say=lambda m: print(m, file=sys.stderr))
    doc = report.as_json()
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for check in report.checks:
            print(f"{'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
        if report.ok:
            for key in ("model_id", "architecture", "backend", "device", "dtype", "numerics", "compat_key",
                        "parameter_bytes",
                        "rss_growth_bytes", "load_s", "decode_tok_s"):
                print(f"{key:>16}: {doc[key]}")
        else:
            print(f"meshctl: {model} layers {list(report.layers)} would not be served: {report.error}",
                  file=sys.stderr)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshctl",
        description="Operate a meshd mesh: built-in models, demos and diagnostics.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="manage model directories")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    create = model_sub.add_parser(
        "create",
        help="generate a built-in model deterministically (no downloads)",
        description="Write a built-in model as a Hugging Face directory (safetensors, float32) or as one GGUF "
        "file, from the same weights. The same name and options always give byte-identical files.",
    )
    create.add_argument("name", choices=BUILTIN_NAMES, help="which built-in model")
    create.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                        help="a Hugging Face directory (default) or a GGUF file as llama.cpp lays one out")
    create.add_argument("--quant", choices=["f32", "f16", "q8_0", "q4_k"], default="f32",
                        help="GGUF weights: f32 (default), f16, q8_0, or q4_k (llama.cpp's Q4_K_M mix; needs "
                        "llama-cpp-python, `make native`)")
    create.add_argument("--out", metavar="PATH", help="output directory, or file for GGUF (default: "
                        "$MESHD_HOME/models/NAME, or $MESHD_HOME/models/NAME-QUANT.gguf)")
    create.add_argument("--force", action="store_true", help="replace an existing directory or file")
    create.set_defaults(func=_cmd_model_create)

    demo = sub.add_parser("demo", help="run the built-in model split into ranges and compare with one process")
    demo.add_argument("--model", metavar="DIR", help="model directory (default: the built-in tiny model)")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench", help="benchmark the mesh against one process (docs/benchmarks.md)",
        description="Run the standard workload on the model in this process, then through meshes of 1..k local "
        "peers (each its own process, even pinned layer ranges); write one JSON report and print a summary.",
    )
    bench.add_argument("--model", default="bench", metavar="NAME|DIR",
                       help="built-in model name or model directory (default: bench)")
    bench.add_argument("--peers", type=_int_list, metavar="LIST",
                       help="peer counts (default 1,2,3; with --serve 1,3)")
    bench.add_argument("--concurrency", type=_int_list, metavar="LIST",
                       help="concurrent sessions, run on the largest peer count (default 1,4,8)")
    bench.add_argument("--prompt-tokens", type=int, metavar="N", help="prompt length (default 64)")
    bench.add_argument("--new-tokens", type=int, metavar="N", help="tokens to generate (default 128)")
    bench.add_argument("--runs", type=int, metavar="N",
                       help="single-session runs per setup; medians are reported (default 3)")
    bench.add_argument("--out", metavar="FILE",
                       help="JSON report (default: bench-out/bench-MODEL.json, with --serve "
                       "bench-out/serve-MODEL.json)")
    bench.add_argument("--workdir", metavar="DIR", help="keep peer data and logs here (default: a temporary directory)")
    bench.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                       help="gguf: the model as one GGUF file; llama.cpp on the whole file in one process is the "
                       "baseline, and meshes of both engines (llama.cpp ranges, torch) are measured")
    bench.add_argument("--quant", choices=["f32", "f16", "q8_0", "q4_k"],
                       help="with --format gguf and a built-in model: the file's quantization (default q8_0); "
                            "a GGUF file given to --model is measured in its own")
    bench.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="the peers' dtype; the baseline runs transformers in the same dtype (default auto: "
                       "the checkpoint's); int8 also measures float32 in the same run (decode tok/s of one process "
                       "and of each mesh) and the held-out perplexity of the trained model in both")
    bench.add_argument("--link", action="append", type=_link_shapes, metavar="PROFILE[,PROFILE...]",
                       help="also run every mesh with each peer's outgoing peer traffic shaped as this link: lan "
                       "(0.5ms/1Gbit), wifi (3ms±2ms/200Mbit), wan (20ms/50Mbit) or DELAY[±JITTER]/RATE such as "
                       "10ms/100Mbit; repeatable or comma-separated. Each shape's shaper is calibrated first and "
                       "the report gives what it delivered next to what it was set to (default: loopback only)")
    bench.add_argument("--speculative", type=_modes, default=("off",), metavar="MODE[,MODE...]",
                       help="the peers' speculative decoding, each mode run on loopback and on every --link: off, "
                       "ngram, model (needs --draft-model) or auto; with off among them the report gives each "
                       "other mode's decode tok/s over off's (default: off)")
    bench.add_argument("--draft-model", metavar="NAME|DIR",
                       help="built-in model name or directory the peers draft with (--draft-model of meshd run), "
                       "e.g. draft for the built-in trained model")
    serve = bench.add_argument_group(
        "serving (--serve)", "Requests arriving at a server instead of single sessions: a seeded mix of prompt and "
        "output lengths, sent as Poisson arrivals at several rates and from closed-loop clients, to one process "
        "serving the model in static batches (transformers' generate()), to one process batching step by step "
        "(the mesh's engine without the network) and to meshes of each --peers count. "
        "It refuses --concurrency, --runs, --prompt-tokens and --new-tokens.")
    serve.add_argument("--serve", action="store_true",
                       help="run the serving benchmark instead of the standard workload (docs/benchmarks.md)")
    serve.add_argument("--serve-rates", type=_float_list, metavar="LIST",
                       help="Poisson arrival rates in requests/s, e.g. 0.1,0.2 (default: 0.25, 0.5, 0.75, 1 and "
                       "1.5 times the closed-loop capacity of the one process batching step by step, measured first)")
    serve.add_argument("--serve-clients", type=_int_list, metavar="LIST",
                       help="closed-loop client counts: each client sends its next request when its last one ends; "
                       "each one-process server batches up to this many, and up to the largest under Poisson arrivals "
                       "(default 4,8)")
    serve.add_argument("--serve-requests", type=int, metavar="N",
                       help="requests per load, i.e. per rate and per client count (default 8)")
    serve.add_argument("--serve-prompt-tokens", type=_int_list, metavar="LIST",
                       help="prompt lengths each request's is drawn from (default 32,64,128,256,512)")
    serve.add_argument("--serve-new-tokens", type=_int_list, metavar="LIST",
                       help="output lengths each request's is drawn from, generated exactly (no EOS stop) "
                       "(default 16,32,64,128)")
    serve.add_argument("--serve-ttft-bound-s", type=float, metavar="S",
                       help="a server sustains a Poisson rate when its p95 time to first token stays under this "
                       "many seconds there and at every lower rate (default 2.0)")
    serve.add_argument("--serve-share", type=float, metavar="F",
                       help="every server is also sent requests at this share of the Poisson rate the continuous "
                       "one process sustains, so that whether a mesh sustains that share is measured at it, not "
                       "read off the rates around it; 0 for none (default 0.8)")
    serve.add_argument("--seed", type=int, metavar="N",
                       help="seed of the request mix and the arrival gaps: same seed, same requests and arrival "
                       "times (default 0)")
    prefix = bench.add_argument_group(
        "prefix reuse (--prefix)", "A conversation's second turn through a mesh of the largest --peers count (default "
        "3): its time to first token when the route's hops kept the first turn's prefix, against a whole prefill "
        "of the same prompt through the same hops (an entry run with --no-prefix-reuse), with the replies compared "
        "token for token with each other and with one process.")
    prefix.add_argument("--prefix", action="store_true",
                        help="run the prefix-reuse benchmark instead of the standard workload (docs/benchmarks.md)")
    prefix.add_argument("--prefix-tokens", type=int, metavar="N",
                        help="about how many tokens the first turn's prompt has (default 1024)")
    prefix.add_argument("--prefix-conversations", type=int, metavar="N",
                        help="conversations measured, each with another system prompt (default 3)")
    prefix.add_argument("--prefix-new-tokens", type=int, metavar="N",
                        help="tokens each turn generates, exactly (default 32)")
    workers = bench.add_argument_group(
        "prefill workers (--prefill-workers)", "A long prompt sent while its route streams another session's "
        "reply, through an entry that prefills on the route and through one that may prefill on idle replicas of "
        "the route's ranges (a mesh of the largest --peers count, default 3, and as many prefill-only replicas, "
        "each half on its own half of the CPUs): the prompt's time to first token, the other session's steps "
        "meanwhile, and the replies compared with one process.")
    workers.add_argument("--prefill-workers", action="store_true",
                         help="run the prefill-workers benchmark instead of the standard workload "
                         "(docs/benchmarks.md)")
    workers.add_argument("--workers-prompt-tokens", type=int, metavar="N",
                         help="tokens of the long prompt (default 1536)")
    workers.add_argument("--workers-busy-tokens", type=int, metavar="N",
                         help="tokens of the other session's reply, exactly (default 256)")
    workers.add_argument("--workers-new-tokens", type=int, metavar="N",
                         help="tokens the long prompt's reply has, exactly (default 16)")
    workers.add_argument("--workers-repeats", type=int, metavar="N",
                         help="rounds of each kind, each with another prompt (default 2)")
    workers.add_argument("--no-pin", dest="workers_pin", action="store_const", const=False,
                         help="run the route's peers and the replicas on all CPUs, not on a half each")
    bench.set_defaults(func=_cmd_bench)

    bench_relay = sub.add_parser(
        "bench-relay", help="seam latency p50/p95 through a meshd-relay vs direct, JSON report",
        description="Start a local relay and an echo peer reachable both directly and through the relay; time "
        "decode-step and prefill-chunk round trips over each link in the same run. --decode also measures "
        "decode tok/s of a model on two peers, tail direct vs relayed.",
    )
    from meshd.bench.relay_cli import add_arguments as _bench_relay_arguments

    _bench_relay_arguments(bench_relay)
    bench_relay.set_defaults(func=_cmd_bench_relay)

    add_mesh_parsers(sub)
    add_replay_parser(sub)
    add_trace_parser(sub)
    add_sim_parser(sub)

    doctor = sub.add_parser(
        "doctor", help="check a model directory's layers as a peer would before serving them",
        description="Read and hash the checkpoint, load the range, check every weight is finite and that a canonical "
        "input goes through every layer (prefill and decode), and report device, dtype, numerics, memory, decode "
        "speed and compat key. Exits 1 when the range would not be served.")
    doctor.add_argument("--model", required=True, metavar="PATH", help="Hugging Face model directory or GGUF file")
    doctor.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp"],
                        help="what computes the layers, as a peer would (default auto: llama.cpp for a GGUF file "
                        "when installed)")
    doctor.add_argument("--layers", metavar="START:END", help="half-open layer range (default: every layer)")
    doctor.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype to hold and compute in, as a peer would (default auto: the checkpoint's)")
    doctor.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or mps")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_cmd_doctor)

    add_service_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ControlError as exc:  # the daemon is down or refused: one line
        print(f"meshctl: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
