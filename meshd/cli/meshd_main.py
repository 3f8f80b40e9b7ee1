"""``meshd``: the peer daemon."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import trio

from meshd.cli.signals import run_until_signalled
from meshd.daemon.config import DTYPE_CHOICES
from meshd.errors import MeshError, reportable
from meshd.logs import FORMATS as LOG_FORMATS
from meshd.logs import LEVELS as LOG_LEVELS
from meshd.logs import RecentRecords, configure_logging
from meshd.session import SPECULATIVE_MODES

# Busy-wait iterations of an idle OpenMP thread before it sleeps: about 0.1 ms (libgomp counts
# roughly 100 000 per ms), longer than the gaps between a step's regions, short next to a step.
OMP_SPIN_COUNT = 10000


def apply_torch_threads(threads: int) -> int:
    """Set torch's compute threads for this process (0: every CPU it may run on); returns the count.

    The shard host's compute thread computes with that many; every other thread of the daemon with
    one (:func:`meshd.runtime.host.set_compute_threads` says why).
    """
    from meshd.runtime.host import set_compute_threads

    count = threads if threads > 0 else len(os.sched_getaffinity(0))
    set_compute_threads(count)
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshd",
        description="The meshd peer daemon: joins a mesh, serves a layer range of a model, answers the OpenAI API.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run a peer until SIGINT/SIGTERM",
        description="Run one peer. Settings come from --config (TOML), then MESHD_* environment variables, "
        "then these flags. Without --layers the elected tracker tells the peer which layers to load. A peer "
        "with neither --bootstrap nor --invite founds a private mesh; `meshctl invite` on it lets others join.",
    )
    _add_run_arguments(run)
    run.set_defaults(func=_cmd_run)

    join = sub.add_parser(
        "join", help="join a private mesh with an invite token, then run like `meshd run`",
        description="Redeem TOKEN (made by `meshctl invite` on a member) with the peer that issued it, keep the "
        "membership in the data directory, and run the peer. The same as `meshd run --invite TOKEN`; later "
        "starts need no token.")
    join.add_argument("token", help="the invite token")
    _add_run_arguments(join)
    join.set_defaults(func=_cmd_run)

    init = sub.add_parser(
        "init", help="create this peer's identity and a settings file listing every setting",
        description="Create the identity key in the data directory (kept if it exists) and write a TOML "
        "settings file with every setting, its meaning and its default, commented out; then start the peer "
        "with `meshd run --config FILE`. docs/configuration.md lists the same settings.")
    init.add_argument("--config", type=Path, default=Path("meshd.toml"), metavar="FILE",
                      help="settings file to write (default ./meshd.toml)")
    init.add_argument("--data-dir", type=Path, default=Path("meshd-data"), metavar="DIR",
                      help="identity and state (default ./meshd-data); written into the settings file")
    init.add_argument("--force", action="store_true", help="replace an existing settings file")
    init.set_defaults(func=_cmd_init)
    return parser


def _add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--config", type=Path, metavar="FILE", help="TOML file with any of the settings below")
    run.add_argument("--data-dir", metavar="DIR", help="identity key and state (default ./meshd-data)")
    run.add_argument("--name", help="a label for this peer in meshctl peers")
    run.add_argument("--listen", metavar="HOST:PORT", help="peer transport listener (default 127.0.0.1:7700)")
    run.add_argument("--advertise", metavar="HOST:PORT", help="address other peers dial (default: --listen)")
    run.add_argument("--api", metavar="HOST:PORT", help="OpenAI API listener (default 127.0.0.1:8000)")
    run.add_argument("--control", metavar="HOST:PORT", help="meshctl control API (default 127.0.0.1:7701)")
    run.add_argument("--metrics", metavar="HOST:PORT",
                     help="Prometheus /metrics listener (default 127.0.0.1:7702; '' turns it off)")
    run.add_argument("--bootstrap", action="append", metavar="HOST:PORT",
                     help="a peer to join through (repeatable)")
    run.add_argument("--invite", metavar="TOKEN",
                     help="join a private mesh with this invite token (from `meshctl invite`); redeemed once, the "
                     "membership is kept in the data directory")
    run.add_argument("--open-mesh", dest="open_mesh", action="store_true", default=None,
                     help="take part in an open mesh: admit any peer that can reach this one (default: private; "
                     "not with an invite)")
    run.add_argument("--relay", dest="relays", action="append", metavar="HOST:PORT",
                     help="a meshd-relay to register with when not directly dialable (repeatable; reachability "
                     "auto or relayed)")
    run.add_argument("--reachability", choices=["auto", "direct", "relayed"],
                     help="auto: let other peers test whether we can be dialled (default); direct: always "
                     "advertise --advertise; relayed: advertise only relay addresses")
    run.add_argument("--model", metavar="PATH",
                     help="the model this peer can serve: a Hugging Face directory or a GGUF file")
    run.add_argument("--model-id", metavar="NAME",
                     help="the model's name in the API (default: the directory's name, or the GGUF file's without "
                     ".gguf). Without --model: serve NAME without copying it here, by fetching its config, tokenizer "
                     "and the tensors of the layers placed on this peer from the peers that serve it (each chunk "
                     "checked against the compat key; kept under the data directory, resumed after a restart), "
                     "computed as they compute it: --backend, --dtype and --numerics are for --model only")
    run.add_argument("--backend", choices=["auto", "torch", "llama.cpp"],
                     help="what computes the layers: llama.cpp (GGUF files, needs `make native`) or torch "
                     "(every model; GGUF weights dequantized); default auto: llama.cpp for a GGUF file when "
                     "it is installed")
    run.add_argument("--layers", metavar="START:END", help="pin this half-open layer range instead of placement")
    run.add_argument("--dtype", choices=DTYPE_CHOICES,
                     help="dtype of weights, activations and the seam (default auto: the checkpoint's own); "
                     "how linears compute in it is measured at start and shown by meshctl status. int8 (CPU, "
                     "torch backend): linears' weights int8, activations, KV and the seam float32")
    run.add_argument("--numerics", metavar="CLASS",
                     help="pin the numerics class (as meshctl status shows it) instead of measuring the fastest here; "
                     "give every peer of a model the same one to keep them in one class")
    run.add_argument("--device", metavar="DEVICE",
                     help="auto (default: cuda:0, else mps, else cpu), cpu, cuda, cuda:N or mps")
    run.add_argument("--memory-budget", metavar="SIZE", help="bytes of weights this peer may load (e.g. 6GiB)")
    run.add_argument("--kv-budget", metavar="SIZE", help="bytes of KV state across sessions (e.g. 1GiB)")
    run.add_argument("--chunk-tokens", type=int, help="prefill chunk size in tokens (default 512)")
    run.add_argument("--prefix-kv", metavar="SIZE",
                     help="bytes of KV this peer keeps of prompt prefixes (the end of a chat's first and last "
                     "message) for later prompts that start with them to reuse instead of prefilling again "
                     "(default 256MiB, inside --kv-budget and giving way to running sessions; 0: keep none)")
    run.add_argument("--kv-tier", metavar="SIZE",
                     help="memory this peer lends to the KV tier (e.g. 4GiB; default 0: none): hops publish the "
                     "prefix KV they keep there, and a hop that lost a prefix imports it instead of prefilling "
                     "again. A tier peer needs no model")
    run.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false", default=None,
                     help="as the entry, prefill every prompt in full instead of starting after a prefix the "
                     "route's hops kept (replies are the same either way)")
    run.add_argument("--prefill-only", action="store_true", default=None,
                     help="serve the pinned range (--layers) only as a prefill worker: entries may have this peer "
                     "prefill long prompts for routes through other peers, but no route decodes through it")
    run.add_argument("--prefill-workers", type=int, metavar="TOKENS",
                     help="as the entry, let idle peers serving the same layers prefill prompts of TOKENS or more "
                     "(default 1024) when the route runs other sessions and the cost model says it is faster; the "
                     "route's hops import the KV before the first token, and replies are the same either way. "
                     "0: never")
    run.add_argument("--torch-threads", type=int, metavar="N",
                     help="threads for model compute (default 0: every CPU this process may use)")
    run.add_argument("--compression", choices=["auto", "off", "always"],
                     help="zstd for large prefill bundles: auto: per link, where measured to save time "
                     "(default); off: never; always: every bundle of 64 KiB or more")
    run.add_argument("--link-shape", metavar="PROFILE",
                     help="for testing and benchmarks only: delay this peer's outgoing peer-to-peer traffic (every "
                     "connection to another peer, dialled or accepted; not the API or control listeners) as if it "
                     "crossed a link of this shape: lan (0.5ms/1Gbit), wifi (3ms±2ms/200Mbit), wan (20ms/50Mbit) or "
                     "DELAY[±JITTER]/RATE such as 10ms/100Mbit. Give every peer the same one to shape both "
                     "directions of every link")
    run.add_argument("--speculative", choices=SPECULATIVE_MODES,
                     help="speculative decoding for requests this peer is the entry of: each step also sends tokens "
                     "guessed ahead, verified by the route in the same traversal, so over slow links a reply needs "
                     "fewer traversals and stays exactly the same (default auto: --draft-model when it shares the "
                     "model's tokenizer, else n-gram lookup over prompt and reply)")
    run.add_argument("--draft-model", metavar="DIR",
                     help="a small model directory with the served model's tokenizer, run on this peer to guess "
                     "tokens ahead with --speculative auto or model (meshctl model create draft makes one for the "
                     "built-in trained model)")
    run.add_argument("--max-draft-tokens", type=int, metavar="N",
                     help="most tokens a step guesses ahead (default 8, at most 15; 0: none)")
    run.add_argument("--audit-rate", type=float, metavar="SHARE",
                     help="share of the requests this peer is the entry of that are followed by an audit of one hop "
                     "(default 0.02; 0: none): a short greedy replay of a synthetic prompt on three routes differing "
                     "in that hop")
    run.add_argument("--capture", choices=["off", "metadata", "full"],
                     help="record the requests this peer answers as the entry, for `meshctl replay` (default off): "
                     "metadata keeps model, route, sampling, seed, token counts, timings and keyed hashes of prompt "
                     "and reply, never their text; full also keeps request bodies and replies (credential fields "
                     "redacted): people's prompts on disk, so only when that is allowed")
    run.add_argument("--capture-max-records", type=int, metavar="N",
                     help="most capture records kept (default 10000); the oldest go first")
    run.add_argument("--capture-max-bytes", metavar="SIZE", help="most bytes of capture kept (default 64MiB)")
    run.add_argument("--capture-max-age", dest="capture_max_age_s", metavar="DURATION",
                     help="longest a capture record is kept: 90s, 30m, 12h, 7d (default 7d)")
    run.add_argument("--no-tracker", dest="tracker_eligible", action="store_false", default=None,
                     help="never take the tracker role")
    run.add_argument("--log-level", choices=LOG_LEVELS,
                     help="least severe records logged (default info)")
    run.add_argument("--log-format", choices=list(LOG_FORMATS),
                     help="text (default): lines for people; json: one object per line with the peer, session and "
                     "route ids, for log collectors")
    run.add_argument("--ready-file", metavar="FILE",
                     help="write this peer's status as JSON here once it listens (for scripts and tests)")


def _cmd_init(args: argparse.Namespace) -> int:
    from meshd.daemon.config import PeerConfig
    from meshd.files import write_atomically
    from meshd.identity import Identity
    from meshd.settings import commented_toml

    config = Path(args.config)
    if config.exists() and not args.force:
        print(f"meshd: {config} exists; --force replaces it", file=sys.stderr)
        return 1
    data_dir = args.data_dir.absolute()
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load_or_create(data_dir)
        config.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(config, commented_toml(PeerConfig, INIT_HEADER, {"data_dir": str(data_dir)}))
    except (OSError, MeshError) as exc:  # MeshError: an identity key on disk that cannot be used
        print(f"meshd: {exc}", file=sys.stderr)
        return 1
    print(f"peer id {identity.peer_id}; identity in {data_dir}; settings in {config}")
    print(f"next: edit {config} (at least `model`; to join a mesh, `invite` with a token from `meshctl invite` "
          f"on a member), then `meshd run --config {config}`")
    return 0


INIT_HEADER = """meshd settings (TOML), written by `meshd init`. Every setting is listed with its meaning and
default, commented out: uncomment what you change. MESHD_<NAME> environment variables and
`meshd run` flags override this file; docs/configuration.md has the same list."""


def _cmd_run(args: argparse.Namespace) -> int:
    # OpenMP threads waiting between the parallel regions of a step should spin a little (waking a
    # sleeping thread costs more than many decode-sized regions) but not long: a peer shares its cores
    # with other work, often other peers, and a thread spinning after its step steals the cores the
    # next hop needs. A bounded spin does both (docs/benchmarks.md has the measurements). Set before
    # torch is imported; an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
    from meshd.daemon.config import load_config

    if getattr(args, "token", None) and args.invite:
        print("meshd: join takes its invite as TOKEN; give --invite only to meshd run", file=sys.stderr)
        return 2
    overrides = {
        "data_dir": args.data_dir, "name": args.name, "listen": args.listen, "advertise": args.advertise,
        "api": args.api, "control": args.control, "metrics": args.metrics, "bootstrap": args.bootstrap,
        "model": args.model, "relays": args.relays, "reachability": args.reachability,
        "model_id": args.model_id, "layers": args.layers, "memory_budget": args.memory_budget,
        "kv_budget": args.kv_budget, "prefix_kv": args.prefix_kv, "kv_tier": args.kv_tier,
        "prefix_reuse": args.prefix_reuse, "prefill_workers": args.prefill_workers,
        "prefill_only": args.prefill_only,
        "chunk_tokens": args.chunk_tokens, "tracker_eligible": args.tracker_eligible,
        "log_level": args.log_level, "log_format": args.log_format, "ready_file": args.ready_file,
        "torch_threads": args.torch_threads,
        "compression": args.compression, "dtype": args.dtype, "device": args.device, "backend": args.backend,
        "audit_rate": args.audit_rate, "capture": args.capture, "capture_max_records": args.capture_max_records,
        "capture_max_bytes": args.capture_max_bytes, "capture_max_age_s": args.capture_max_age_s,
        "numerics": args.numerics, "link_shape": args.link_shape,
        "speculative": args.speculative, "draft_model": args.draft_model, "max_draft_tokens": args.max_draft_tokens,
        "invite": getattr(args, "token", None) or args.invite, "open_mesh": args.open_mesh,
    }
    try:
        config = load_config(args.config, overrides)
    except (ValueError, OSError) as exc:
        print(f"meshd: bad configuration: {exc}", file=sys.stderr)
        return 2
    from meshd.daemon.peer import Peer  # torch and the model code: after the settings are known good
    from meshd.runtime.heap import manage_heap
    recent = RecentRecords()
    context = configure_logging(config.log_level, config.log_format, recent=recent,
                                quiet=("hpack", "h2", "httpx", "httpx2", "filelock"))
    logging.getLogger("meshd").info("compute uses %d torch threads", apply_torch_threads(config.torch_threads))

    try:
        peer = Peer(config, recent_logs=recent)
        context.peer = peer.peer_id
        manage_heap()
        trio.run(run_until_signalled, peer.run, logging.getLogger("meshd"), peer.leave)
    except BaseException as exc:  # only OS and meshd errors are reported in one line; the rest re-raised
        error = reportable(exc)
        if error is None:
            raise
        logging.getLogger("meshd").error("meshd stopped: %s", error)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
