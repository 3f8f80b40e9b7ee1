"""Run the benchmark: the baseline in this process, then meshes of 1..k peers on loopback.

The baseline is measured again after each mesh, and each mesh is compared with the baseline runs
just before and just after it: on a shared machine the speed drifts over minutes, and a ratio taken
against a baseline from several minutes earlier mostly measures the drift. Each mesh is real
``meshd run`` processes (:class:`~meshd.daemon.local_mesh.LocalMesh`) with pinned,
even layer ranges, asked through the head peer's OpenAI API exactly as a user would. Peers run with
this process's torch thread count, so the mesh and the baseline compute with the same threads.

With link shapes (``--link``), every peer count is run again for each shape with every peer started
with ``--link-shape``, so both directions of every seam cross the modelled link; each shape's shaper
is calibrated in this process first, and the report sets what it delivered next to what it was set to.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import psutil

from meshd import __version__
from meshd.bench.baseline import Baseline, BaselineResult
from meshd.bench.report import build_report, link_report
from meshd.bench.wakeup import idle_residency, idle_since, measure_wakeups
from meshd.bench.workload import Prompt, StreamTiming, build_prompt, stream_completion
from meshd.cli.demo import even_ranges
from meshd.daemon.local_mesh import LocalMesh, LocalMeshError, LocalPeer
from meshd.links.calibrate import calibrate
from meshd.links.profiles import LinkShape
from meshd.models.builtin import BUILTIN_MODELS, default_model_dir, ensure_builtin
from meshd.progress import Progress, progress
from meshd.runtime.cpu_info import cpu_model, kernel_features
from meshd.runtime.machine_share import BUSY_FIELDS
from meshd.runtime.numerics import Numerics

Say = Callable[[str], None]

PEER_START_TIMEOUT_S = 180.0
COVER_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class BenchConfig:
    model: str  # a built-in model's name or a model directory
    peers: tuple[int, ...]
    concurrency: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    runs: int = 3
    workdir: Path | None = None
    dtype: str = "auto"  # the peers' --dtype; the baseline runs transformers in the same dtype
    format: str = "safetensors"  # or "gguf": llama.cpp is the baseline, and both engines are measured
    quant: str = "q8_0"  # the GGUF file's quantization, for a built-in model
    links: tuple[LinkShape, ...] = ()  # meshes again on each shaped link, after the loopback ones
    speculative: tuple[str, ...] = ("off",)  # the peers' --speculative, each run on loopback and every link
    draft_model: str | None = None  # a built-in model's name or a directory: the peers' --draft-model


@dataclass
class MeshResult:
    """One mesh of ``peers`` processes: its single-session runs, /stats per hop and memory."""

    peers: int
    ranges: list[tuple[int, int]]
    runs: list[StreamTiming]
    baseline_tok_s: list[float]  # the baseline's runs just before and just after this mesh
    identical: list[bool]
    hop_stats: list[dict]  # each hop's /stats after the single-session runs, in route order
    peer_ids: list[str]
    rss_mb: list[float]
    numerics: str = ""
    texts: list[str] = field(default_factory=list)  # what each single-session run answered
    aggregate_tok_s: dict[int, float] = field(default_factory=dict)
    # one process, batched generate() at batch c: the mean of its runs just before and just after the mesh
    ceiling_tok_s: dict[int, float] = field(default_factory=dict)
    ceiling_runs_tok_s: dict[int, list[float]] = field(default_factory=dict)
    batches: list[dict] = field(default_factory=list)  # each hop's batcher counts over the concurrent runs
    compute_share: dict[int, dict] = field(default_factory=dict)  # per concurrency: the hops' compute / wall
    cpu_share: dict[int, dict] = field(default_factory=dict)  # per concurrency: CPUs used by client, peers, machine
    route: dict = field(default_factory=dict)  # the route the entry plans after the runs, with its cost terms


def resolve_model(spec: str, say: Say) -> Path:
    """A built-in model by name (created if missing) or an existing model directory."""
    if spec in BUILTIN_MODELS:
        target = default_model_dir(spec)
        if not (target / "config.json").is_file():
            say(f"creating built-in model {spec!r} in {target}")
        return ensure_builtin(spec, target)
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise BenchError(f"{spec!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
                         "nor a model directory with a config.json")
    return path


def splittable_model(spec: str, peers: tuple[int, ...], say: Say) -> tuple[Path, int]:
    """The model directory (:func:`resolve_model`) and its layer count, which every peer count must fit."""
    from transformers import AutoConfig

    model_dir = resolve_model(spec, say)
    n_layers: int = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    if max(peers) > n_layers:
        raise BenchError(f"{model_dir.name} has {n_layers} layers; it cannot be split over {max(peers)} peers")
    return model_dir, n_layers


def resolve_gguf(spec: str, quant: str, say: Say) -> Path:
    """A built-in model as a GGUF file of ``quant`` (written if missing) or an existing GGUF file."""
    if spec in BUILTIN_MODELS:
        from meshd.models.gguf_export import create_builtin_gguf

        target = default_model_dir(spec).with_name(f"{spec}-{quant}.gguf")
        if not target.is_file():
            say(f"creating built-in model {spec!r} as {quant} GGUF in {target}")
            create_builtin_gguf(spec, target, quant, say)
        return target
    path = Path(spec)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise BenchError(f"{spec!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a GGUF file")
    return path


class _Measures(Protocol):
    def measure(self, runs: int) -> BaselineResult: ...


@runtime_checkable
class _Batches(Protocol):
    def batched_tok_s(self, batch: int) -> float: ...


@dataclass(frozen=True)
class Setup:
    """One way of running the meshes: a label ("" for the plain loopback run), the peers' flags, the
    link shape every peer's outgoing peer traffic travels (None: plain loopback), and the peers'
    speculative decoding mode."""

    label: str
    flags: tuple[str, ...]
    link: LinkShape | None = None
    speculative: str = "off"
    reference: str = ""  # the one process its meshes are compared with: "" the run's own, or a dtype

    @property
    def link_label(self) -> str:
        return self.link.label if self.link is not None else "loopback"


def speculative_setups(cfg: BenchConfig, draft_dir: Path | None) -> list[Setup]:
    """Loopback and then each link, each with every speculative mode, in that order; the first is
    the plain loopback run the top of the report describes (label "")."""
    out: list[Setup] = []
    for link in (None, *cfg.links):
        for mode in cfg.speculative:
            flags = ["--dtype", cfg.dtype, "--speculative", mode]
            if draft_dir is not None and mode in ("auto", "model"):
                flags += ["--draft-model", str(draft_dir)]
            label = "" if not out else (f"{link.label if link is not None else 'loopback'}, speculative {mode}"
                                        if len(cfg.speculative) > 1 else link.label if link is not None else "")
            out.append(Setup(label, tuple(flags), link, mode))
    return out


@dataclass
class Reference:
    """One process computing as some setups' meshes do: its measurements (the first taken before any
    mesh, then one after each of theirs) and the text its greedy run answers."""

    base: _Measures
    measured: list[BaselineResult]
    expected: str


def _bracketed_meshes(setups: list[Setup], model: Path, model_id: str, n_layers: int, prompt: Prompt,
                      references: dict[str, Reference], cfg: BenchConfig, say: Say) -> dict[str, list[MeshResult]]:
    """Each setup as a mesh of every peer count, each followed by runs of its reference (which is
    measured again first when the mesh before was another's), so that a mesh's ratio uses its
    baseline measured just before and just after it (appended to the reference's ``measured``). A
    failure keeps the peers' logs and says where."""
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    out: dict[str, list[MeshResult]] = {}
    last = setups[0].reference if setups else ""
    try:
        with _overall(len(setups) * len(cfg.peers)) as bar:
            for setup in setups:
                label = setup.label
                ref = references[setup.reference]
                measured = ref.measured
                for k in sorted(cfg.peers):
                    levels = sorted(cfg.concurrency) if k == max(cfg.peers) else []
                    if setup.reference != last:
                        measured.append(ref.base.measure(cfg.runs))
                        last = setup.reference
                    batched = ref.base if isinstance(ref.base, _Batches) else None  # llama.cpp's has no ceiling
                    batches = [c for c in levels if c > 1]
                    before = _ceiling(batched, batches, "before the mesh", say)
                    if label:
                        say(f"{label}: mesh of {k}")
                    mesh = _measure_mesh(model, model_id, k, even_ranges(n_layers, k), prompt, ref.expected,
                                         measured[0], cfg, workdir / f"{_slug(label) + '-' if label else ''}peers{k}",
                                         levels, say, setup)
                    after = _ceiling(batched, batches, "after the mesh", say)
                    mesh.ceiling_runs_tok_s = {c: [before[c], after[c]] for c in before}
                    mesh.ceiling_tok_s = {c: (before[c] + after[c]) / 2 for c in before}
                    measured.append(ref.base.measure(cfg.runs))
                    mesh.baseline_tok_s = measured[-2].runs_tok_s + measured[-1].runs_tok_s
                    say(f"baseline: {measured[-1].decode_tok_s:.2f} tok/s")
                    out.setdefault(label, []).append(mesh)
                    bar.advance(note=f"{label + ', ' if label else ''}{k} peers done")
    except Exception:
        say(f"peer logs kept in {workdir}")
        raise
    if cfg.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def _ceiling(base: _Batches | None, batches: list[int], when: str, say: Say) -> dict[int, float]:
    """One process's batched ``generate()`` at each batch size, measured on either side of a mesh so that
    its concurrent aggregate is compared with the mean of the two, as its single session is with the
    baseline runs around it: the machine's speed drifts by several percent within minutes."""
    if base is None or not batches:
        return {}
    measured = {c: base.batched_tok_s(c) for c in batches}
    say(f"one process, batched generate() {when}: " + ", ".join(f"batch {c}: {v:.2f} tok/s"
                                                            for c, v in measured.items()))
    return measured


def _slug(label: str) -> str:
    """A setup's label as a directory name (a link shape's spec holds '/' and '±')."""
    return "".join(c if c.isalnum() or c in "._" else "_" for c in label)


def _calibrate_links(shapes: tuple[LinkShape, ...], say: Say) -> dict[str, dict]:
    """What each shape's shaper delivers on loopback in this process, before anything else runs."""
    out: dict[str, dict] = {}
    for shape in shapes:
        got = calibrate(shape).as_json()
        say(f"link {shape.label} ({shape.spec}): shaper delivered one-way delay p50/p95 "
            f"{got['measured_delay_ms_p50']:.3f}/{got['measured_delay_ms_p95']:.3f} ms, jitter "
            f"{got['measured_jitter_ms']:.3f} ms, rate {got['measured_rate_mbit'] or 0:.1f} Mbit/s")
        out[shape.label] = got
    return out


def _overall(meshes: int) -> AbstractContextManager[Progress]:
    """A bar over the meshes on a terminal; off one, the bench's own lines already say each step."""
    return progress("bench", meshes, "meshes", say=lambda _line: None)


def _prepare(cfg: BenchConfig) -> None:
    """Check the counts and keep transformers offline and quiet."""
    if cfg.runs < 1 or cfg.new_tokens < 2 or cfg.prompt_tokens < 1:
        raise BenchError("--runs and --prompt-tokens must be at least 1, --new-tokens at least 2")
    quiet_transformers()


def quiet_transformers() -> None:
    """Keep transformers offline and quiet: its bars would interleave with the bench's lines."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def machine_meta(threads: int, load_start_1m: float) -> dict[str, Any]:
    """Where and with what a report was measured: threads, CPUs, versions, date, and the 1-minute load
    at the start and now (other work on the machine skews every figure)."""
    import torch
    import transformers

    return {
        "torch_threads": threads, "cpu_count": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "cpu_model": cpu_model(), "cpu_features": kernel_features(),
        "meshd_version": __version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg_1m": [round(load_start_1m, 2), round(os.getloadavg()[0], 2)],
    }


def run_bench(cfg: BenchConfig, say: Say) -> dict:
    """Measure everything and return the report object (see :func:`meshd.bench.report.build_report`)."""
    if cfg.format == "gguf":
        # the file's quantization is the dtype, and both engines run without speculation on loopback
        given = [flag for flag, set_ in (("--link", bool(cfg.links)), ("--dtype", cfg.dtype != "auto"),
                                         ("--speculative", cfg.speculative != ("off",))) if set_]
        if given:
            raise BenchError(f"--format gguf does not take {', '.join(given)}: they apply to the safetensors "
                             "benchmark (the GGUF file's quantization is its dtype)")
        return run_gguf_bench(cfg, say)
    _prepare(cfg)
    import torch
    from transformers import AutoTokenizer

    model_dir, n_layers = splittable_model(cfg.model, cfg.peers, say)
    model_id = model_dir.name
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = build_prompt(tokenizer, cfg.prompt_tokens)
    if len(prompt.ids) != cfg.prompt_tokens:
        say(f"note: no text encodes to exactly {cfg.prompt_tokens} tokens; using {len(prompt.ids)}")

    load_start = os.getloadavg()
    if load_start[0] > 0.5:
        say(f"note: 1-minute load average is {load_start[0]:.2f} before starting; other work skews the figures")
    idle_at_start = idle_residency()
    say("wake-up latency of this machine (threads and processes, hot and after idling)")
    wakeups = measure_wakeups()
    shapers = _calibrate_links(cfg.links, say)
    say(f"baseline: {model_id} in this process, {torch.get_num_threads()} torch threads, "
        f"{len(prompt.ids)} prompt + {cfg.new_tokens} new tokens, {cfg.runs} runs before and after each mesh")
    from meshd.runtime.numerics import INT8
    from meshd.runtime.shard import resolve_dtype

    held = resolve_dtype(cfg.dtype, model_dir)
    int8 = cfg.dtype == INT8
    classes = PeerClasses(model_dir)
    say(f"dtype: {cfg.dtype if int8 else held} (the peers' --dtype {cfg.dtype}; transformers computes the "
        f"baseline so); the peers compute as {classes.of(cfg.dtype).name}, measured here and pinned")

    def reference(dtype: Any, int8: bool, setting: str, label: str = "") -> Reference:
        base = Baseline(model_dir, prompt.ids, cfg.new_tokens, dtype=dtype, int8=int8, numerics=classes.of(setting))
        first = base.measure(cfg.runs)
        say(f"baseline{label}: {first.decode_tok_s:.2f} tok/s, TTFT {first.ttft_ms:.1f} ms")
        return Reference(base, [first], tokenizer.decode(first.token_ids, skip_special_tokens=True))

    default_kernels = None
    if classes.of(cfg.dtype).prefill_onednn or classes.of(cfg.dtype).decode_onednn:
        default_kernels = transformers_default(model_dir, prompt.ids, held, int8, cfg, say)
    references = {"": reference(held, int8, cfg.dtype)}
    measured = references[""].measured

    draft_dir = resolve_model(cfg.draft_model, say) if cfg.draft_model else None
    setups = speculative_setups(cfg, draft_dir)
    if int8:  # the plain loopback meshes again in float32, each against one float32 process
        references[FLOAT32] = reference(torch.float32, False, FLOAT32, f" ({FLOAT32})")
        setups.append(replace(setups[0], label=FLOAT32, flags=_with_dtype(setups[0].flags, FLOAT32),
                              reference=FLOAT32))
    setups = [replace(setup, flags=classes.pinned(setup.flags)) for setup in setups]
    by_setup = _bracketed_meshes(setups, model_dir, model_id, n_layers, prompt, references, cfg, say)
    meshes = by_setup[""]
    baseline = _pooled(measured)

    meta = {
        "model": model_id, "model_dir": str(model_dir), "prompt_tokens": len(prompt.ids),
        "prompt_tokens_requested": cfg.prompt_tokens, "new_tokens": cfg.new_tokens, "runs": cfg.runs,
        **machine_meta(baseline.torch_threads, load_start[0]),
        "dtype": cfg.dtype if int8 else str(held).removeprefix("torch."),
        "numerics": meshes[0].numerics if meshes else None,
        "wakeup": {**wakeups, "idle_s_by_state": idle_since(idle_at_start)},
    }
    meta["speculative"] = setups[0].speculative
    meta["draft_model"] = draft_dir.name if draft_dir is not None else None
    meta["baseline_linears"] = "the peers'" if default_kernels is not None else "torch's own"
    report = build_report(meta, baseline, meshes)
    if default_kernels is not None:
        report["transformers_default"] = default_kernels.summary(report)

    def variants(link: LinkShape | None) -> list[tuple[dict, list]]:
        return [({"link": s.link_label, "speculative": s.speculative}, by_setup[s.label]) for s in setups
                if s.link == link]

    if len(cfg.speculative) > 1:
        report["loopback"] = {"meshes": [{"setup": setup, **build_report({}, baseline, found)}
                                         for setup, found in variants(None)]}
    if cfg.links:
        report["links"] = {shape.label: link_report(shape, shapers[shape.label], baseline, variants(shape))
                           for shape in cfg.links}
    report["speculative_speedup"] = speculative_speedup(report)
    if int8:
        report[FLOAT32] = build_report({"dtype": FLOAT32, "numerics": by_setup[FLOAT32][0].numerics},
                                       _pooled(references[FLOAT32].measured), by_setup[FLOAT32])
        report["int8_speedup"] = int8_speedup(report, report[FLOAT32])
        report["quality"] = int8_quality(say)
    return report


FLOAT32 = "float32"


class PeerClasses:
    """The numerics class a peer of each ``--dtype`` would measure for the model on this machine,
    measured once here: the bench pins its peers to it (``--numerics``), so that a burst of load while
    they start cannot split them into classes that share no route, and its one process computes
    like them (:func:`meshd.runtime.numerics.linears_like`)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._chosen: dict[str, Numerics] = {}

    def of(self, dtype: str) -> Numerics:
        if dtype not in self._chosen:
            from meshd.runtime.model_info import choose_numerics

            # on a thread of its own, whose OpenMP team ends with it: a process whose threads hold more
            # OpenMP threads than it has CPUs stops them spinning (meshd.runtime.host), and --serve's one
            # process computes on a thread of its own
            with ThreadPoolExecutor(max_workers=1) as measuring:
                self._chosen[dtype] = measuring.submit(choose_numerics, self.model_dir, dtype).result().numerics
        return self._chosen[dtype]

    def pinned(self, flags: tuple[str, ...]) -> tuple[str, ...]:
        """The peers' flags with ``--numerics`` naming the class of their ``--dtype``."""
        return (*flags, "--numerics", self.of(flags[flags.index("--dtype") + 1]).name)


@dataclass(frozen=True)
class DefaultKernels:
    """transformers with torch's own kernels, where the peers compute otherwise (oneDNN): measured
    once before the meshes, for what meshd's choice of kernels gives over plain transformers."""

    measured: BaselineResult
    ceiling_tok_s: dict[int, float]

    def summary(self, report: dict) -> dict[str, Any]:
        tok_s = self.measured.decode_tok_s
        return {"decode_tok_s": round(tok_s, 2), "ttft_ms": round(self.measured.ttft_ms, 1),
                "ceiling_tok_s": {str(c): round(v, 2) for c, v in self.ceiling_tok_s.items()},
                "baseline_over_default": round(report["baseline_tok_s"] / tok_s, 3) if tok_s else None,
                "mesh_over_default": {k: round(v / tok_s, 3) if tok_s else None
                                      for k, v in report["mesh_tok_s"].items()}}


def transformers_default(model_dir: Path, prompt_ids: list[int], dtype: Any, int8: bool, cfg: BenchConfig,
                         say: Say) -> DefaultKernels:
    base = Baseline(model_dir, prompt_ids, cfg.new_tokens, dtype=dtype, int8=int8)
    measured = base.measure(cfg.runs)
    ceiling = {c: base.batched_tok_s(c) for c in sorted(cfg.concurrency) if c > 1}
    say(f"transformers with torch's own kernels (once, for comparison): {measured.decode_tok_s:.2f} tok/s, TTFT "
        f"{measured.ttft_ms:.1f} ms" + "".join(f", batch {c}: {v:.2f} tok/s" for c, v in ceiling.items()))
    return DefaultKernels(measured, ceiling)


def _with_dtype(flags: tuple[str, ...], dtype: str) -> tuple[str, ...]:
    """The peers' flags with ``--dtype`` set to ``dtype``."""
    out = list(flags)
    at = out.index("--dtype")
    out[at + 1] = dtype
    return tuple(out)


def int8_speedup(int8: dict, fp32: dict) -> dict[str, Any]:
    """Decode tok/s at int8 over float32, both measured in this run: of one process, and of the mesh
    of each peer count."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a and b else None

    return {"one_process": ratio(int8["baseline_tok_s"], fp32["baseline_tok_s"]),
            "mesh": {k: ratio(tok_s, fp32["mesh_tok_s"].get(k)) for k, tok_s in int8["mesh_tok_s"].items()}}


QUALITY_MODEL = "trained"  # a built-in model with real statistics: perplexity means something


def int8_quality(say: Say) -> dict[str, Any]:
    """Held-out perplexity of the built-in ``trained`` model in float32 and at int8, and the relative
    increase (created, and trained, first when it is not there yet)."""
    from meshd.models.trained import heldout_perplexity

    model_dir = resolve_model(QUALITY_MODEL, say)
    fp32, int8 = (heldout_perplexity(model_dir, int8=q).perplexity for q in (False, True))
    say(f"held-out perplexity of {QUALITY_MODEL}: float32 {fp32:.3f}, int8 {int8:.3f} "
        f"({(int8 / fp32 - 1) * 100:+.2f} %)")
    return {"model": QUALITY_MODEL, "perplexity": {FLOAT32: round(fp32, 4), "int8": round(int8, 4)},
            "perplexity_increase": round(int8 / fp32 - 1, 5)}


def speculative_speedup(report: dict) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per link (and loopback), per speculative mode other than off: its decode tok/s over off's, by
    peer count, both measured in this run."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    places = {"loopback": report.get("loopback", {})} | report.get("links", {})
    for place, found in places.items():
        by_mode = {v["setup"]["speculative"]: v for v in found.get("meshes", [])}
        plain = by_mode.get("off")
        if plain is None:
            continue
        for mode, variant in by_mode.items():
            if mode != "off":
                out.setdefault(place, {})[mode] = {
                    k: (round(tok_s / plain["mesh_tok_s"][k], 4) if plain["mesh_tok_s"].get(k) else None)
                    for k, tok_s in variant["mesh_tok_s"].items()}
    return out


GGUF_PATHS = (Setup("llama.cpp", ("--backend", "llama.cpp")), Setup("torch", ("--backend", "torch")))
AGREEMENT_STEPS = 256


def run_gguf_bench(cfg: BenchConfig, say: Say) -> dict:
    """The GGUF benchmark: llama.cpp on the whole file in this process as the baseline, then meshes
    of each engine (llama.cpp ranges, torch on dequantized weights) at every peer count, each
    bracketed by the baseline; then how often the torch path picks llama.cpp's greedy token."""
    _prepare(cfg)
    import torch
    from transformers import AutoTokenizer

    from meshd.bench.llamacpp_baseline import LlamaCppBaseline, top1_agreement
    from meshd.models.gguf_model import default_cache_root, gguf_model_dir
    from meshd.runtime.gguf_checkpoint import open_gguf, quantization_of
    from meshd.runtime.loader import load_config

    gguf_path = resolve_gguf(cfg.model, cfg.quant, say)
    model_dir = gguf_model_dir(gguf_path, default_cache_root())
    model_id = gguf_path.stem
    n_layers = load_config(model_dir).num_hidden_layers
    if max(cfg.peers) > n_layers:
        raise BenchError(f"{model_id} has {n_layers} layers; it cannot be split over {max(cfg.peers)} peers")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = build_prompt(tokenizer, cfg.prompt_tokens)
    threads = torch.get_num_threads()
    load_start = os.getloadavg()
    idle_at_start = idle_residency()
    say("wake-up latency of this machine (threads and processes, hot and after idling)")
    wakeups = measure_wakeups()
    say(f"baseline: llama.cpp, {gguf_path.name} whole in this process, {threads} threads")
    base = LlamaCppBaseline(gguf_path, prompt.ids, cfg.new_tokens, threads)
    measured = [base.measure(cfg.runs)]
    expected = tokenizer.decode(measured[0].token_ids, skip_special_tokens=True)
    say(f"baseline: {measured[0].decode_tok_s:.2f} tok/s, TTFT {measured[0].ttft_ms:.1f} ms")
    by_path = _bracketed_meshes(list(GGUF_PATHS), gguf_path, model_id, n_layers, prompt,
                                {"": Reference(base, measured, expected)}, cfg, say)
    reference = base.generate(AGREEMENT_STEPS)
    base.close()
    say(f"top-1 agreement: the torch path teacher-forced over llama.cpp's {AGREEMENT_STEPS} greedy tokens")
    agreement = top1_agreement(model_dir, prompt.ids, reference)
    baseline = _pooled(measured)
    meta = {
        "model": model_id, "model_path": str(gguf_path), "format": "gguf",
        "quantization": quantization_of(open_gguf(gguf_path)), "file_bytes": gguf_path.stat().st_size,
        "baseline_engine": "llama.cpp (llama-cpp-python, whole model in the bench process)",
        "prompt_tokens": len(prompt.ids), "prompt_tokens_requested": cfg.prompt_tokens,
        "new_tokens": cfg.new_tokens, "runs": cfg.runs, "torch_threads": threads, "cpu_count": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False), "cpu_model": cpu_model(),
        "cpu_features": kernel_features(), "meshd_version": __version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg_1m": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "wakeup": {**wakeups, "idle_s_by_state": idle_since(idle_at_start)},
    }
    from meshd.runtime.loader import checkpoint_dtype

    dtypes = {"llama.cpp": meta["quantization"], "torch": str(checkpoint_dtype(model_dir)).removeprefix("torch.")}
    paths = {path: build_report({**meta, "dtype": dtypes[path], "numerics": meshes[0].numerics}, baseline, meshes)
             for path, meshes in by_path.items()}
    return {**meta, "top1_agreement": round(agreement, 4), "top1_agreement_steps": AGREEMENT_STEPS,
            "paths": paths, "split_identical": all(r["split_identical"] for r in paths.values())}


def _pooled(measured: list[BaselineResult]) -> BaselineResult:
    """Every baseline measurement of the run as one (medians over all their runs)."""
    tok_s = [v for m in measured for v in m.runs_tok_s]
    ttft = [v for m in measured for v in m.runs_ttft_ms]
    return replace(measured[0], decode_tok_s=statistics.median(tok_s), ttft_ms=statistics.median(ttft),
                   runs_tok_s=tok_s, runs_ttft_ms=ttft)


@dataclass(frozen=True)
class RunningMesh:
    """A started mesh: its peers in start order (the first is the head and the entry), the same peers in
    route order, and an OpenAI client on the entry's API."""

    peers: list[LocalPeer]
    hops: list[LocalPeer]
    client: Any


@contextmanager
def running_mesh(model_dir: Path, model_id: str, ranges: list[tuple[int, int]], threads: int, workdir: Path,
                 say: Say, setup: Setup) -> Iterator[RunningMesh]:
    """``meshd run`` processes on loopback holding ``ranges`` (the first is the head), each computing with
    ``threads`` torch threads, covered and ready for requests; stopped on exit."""
    from openai import OpenAI

    k = len(ranges)
    env = {"MESHD_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    link = setup.link.spec if setup.link is not None else None
    with LocalMesh(workdir, log_level="warning", env=env, link_shape=link) as mesh:
        say(f"mesh of {k}: starting peers with layers {', '.join(f'[{s},{e})' for s, e in ranges)}")
        started = time.monotonic()
        peers = mesh.start_peers([{"model": model_dir, "layers": r, "extra": list(setup.flags)} for r in ranges],
                                 timeout=PEER_START_TIMEOUT_S)
        mesh.wait_covered(model_id, timeout=COVER_TIMEOUT_S)
        say(f"mesh of {k}: covered after {time.monotonic() - started:.1f}s")
        hops = sorted(peers, key=lambda p: p.get("/status")["range"][0])
        client = OpenAI(base_url=f"http://{peers[0].api}/v1", api_key="meshd", timeout=REQUEST_TIMEOUT_S,
                        max_retries=0)
        yield RunningMesh(peers, hops, client)
        say(f"mesh of {k}: stopping")


def _measure_mesh(model_dir: Path, model_id: str, k: int, ranges: list[tuple[int, int]], prompt: Prompt,
                  expected: str, baseline: BaselineResult, cfg: BenchConfig, workdir: Path,
                  levels: list[int], say: Say, setup: Setup) -> MeshResult:
    with running_mesh(model_dir, model_id, ranges, baseline.torch_threads, workdir, say, setup) as running:
        peers, hops, client = running.peers, running.hops, running.client

        def request(max_tokens: int) -> StreamTiming:
            return stream_completion(client, model_id, prompt.text, max_tokens)

        def matches(run: StreamTiming) -> bool:
            return run.text == expected and run.completion_tokens == cfg.new_tokens

        request(min(4, cfg.new_tokens))  # warm-up: connections, routes, first-call allocations
        wait_for_speed_checks(peers[0], say)
        for hop in hops:
            hop.get("/stats?reset=1")
        runs: list[StreamTiming] = []
        for i in range(cfg.runs):
            runs.append(request(cfg.new_tokens))
            say(f"mesh of {k}: run {i + 1}/{cfg.runs}: {runs[-1].decode_tok_s:.2f} tok/s, "
                f"TTFT {runs[-1].ttft_ms:.1f} ms, {'identical' if matches(runs[-1]) else 'DIFFERENT'}")
        identical = [matches(r) for r in runs]
        hop_stats = [hop.get("/stats") for hop in hops]
        planned = peers[0].get(f"/route?model={model_id}")
        rss_mb = [psutil.Process(p.process.pid).memory_info().rss / 2**20 for p in hops]
        result = MeshResult(k, ranges, runs, [], identical, hop_stats, [h.peer_id for h in hops], rss_mb,
                            numerics=hops[0].get("/status")["numerics"], texts=[r.text for r in runs],
                            route=planned)

        if levels:
            for hop in hops:
                hop.get("/stats?reset=1")
        for c in levels:
            before = [hop.get("/stats")["batches"] for hop in hops]
            cpu_before = cpu_snapshot([hop.process.pid for hop in hops])
            with ThreadPoolExecutor(max_workers=c) as pool:
                t0 = time.perf_counter()
                done = list(pool.map(lambda _i: request(cfg.new_tokens), range(c)))
                wall = time.perf_counter() - t0
            result.cpu_share[c] = cpu_share(cpu_before, cpu_snapshot([hop.process.pid for hop in hops]), wall)
            result.compute_share[c] = compute_share(before, [hop.get("/stats")["batches"] for hop in hops], wall)
            result.aggregate_tok_s[c] = sum(r.completion_tokens for r in done) / wall
            result.identical += [matches(r) for r in done]
            same = sum(matches(r) for r in done)
            say(f"mesh of {k}: concurrency {c}: {result.aggregate_tok_s[c]:.2f} tok/s aggregate "
                f"over {wall:.1f}s, {same}/{c} identical")
        if levels:
            result.batches = [hop.get("/stats")["batches"] for hop in hops]
    return result


def compute_share(before: list[dict], after: list[dict], wall_s: float) -> dict:
    """How much of a load's wall time the hops spent computing, from their batchers' compute counters
    read before and after it: per hop, and summed over the hops, split into decode and prefill. Hops
    on one machine take turns at its CPUs, so there a summed share near 1 says the load was bound by
    how fast the hops compute, and the rest of the wall time is what waiting and transfers added."""
    def spent(kind: str) -> list[float]:
        return [max(0.0, a[kind] - b[kind]) for b, a in zip(before, after, strict=True)]

    decode, prefill = spent("decode_compute_s"), spent("prefill_compute_s")
    wall_s = max(wall_s, 1e-9)
    return {"hops": [round((d + p) / wall_s, 4) for d, p in zip(decode, prefill, strict=True)],
            "decode": round(sum(decode) / wall_s, 4), "prefill": round(sum(prefill) / wall_s, 4),
            "summed": round((sum(decode) + sum(prefill)) / wall_s, 4)}


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far by this process (the bench's client), by each peer process (route order),
    by each peer's event loop (its main thread, where Trio runs the transport, the sessions and the API;
    the rest of a peer's time is its compute thread and torch's threads; None where the system does not
    say) and by the whole machine (busy as the machine-share verdict counts it: not idle or waiting)."""

    client: float
    peers: list[float]
    machine: float
    loops: list[float | None]


def cpu_snapshot(peer_pids: list[int]) -> CpuSnapshot:
    def used(pid: int | None) -> float:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:  # a peer that has gone counts nothing more
            return 0.0
        return times.user + times.system

    def used_by_loop(pid: int) -> float | None:
        try:
            threads = psutil.Process(pid).threads()
        except psutil.NoSuchProcess:
            return 0.0
        except psutil.Error:
            return None
        # on Linux a process's main thread has the process's id; elsewhere the ids are not comparable
        main = [t for t in threads if t.id == pid]
        return main[0].user_time + main[0].system_time if main else None

    machine = psutil.cpu_times()
    busy = sum(getattr(machine, name, 0.0) for name in BUSY_FIELDS)
    return CpuSnapshot(used(None), [used(pid) for pid in peer_pids], busy, [used_by_loop(pid) for pid in peer_pids])


def cpu_share(before: CpuSnapshot, after: CpuSnapshot, wall_s: float) -> dict:
    """The CPUs a load kept busy, on average over its wall time: the bench's own process (the OpenAI
    clients streaming the replies, on the same machine as the mesh), each peer, and the machine in all
    (``cpus`` of them). It tells how much of the machine the mesh had, and how much the client took.
    ``loops``: the part of each peer's share its event loop took (None where not known): work done per
    session and message rather than per batch, serial with the hops' computes while one wave travels."""
    wall_s = max(wall_s, 1e-9)

    def share(b: float, a: float) -> float:
        return round(max(0.0, a - b) / wall_s, 4)

    loops = [None if b is None or a is None else share(b, a)
             for b, a in zip(before.loops, after.loops, strict=True)]
    return {"client": share(before.client, after.client),
            "peers": [share(b, a) for b, a in zip(before.peers, after.peers, strict=True)],
            "loops": loops, "machine": share(before.machine, after.machine), "cpus": psutil.cpu_count()}


def say(message: str) -> None:
    """A progress line of the benchmark on stderr, stamped with the time of day."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def written_report(measure: Callable[[Say], dict], out: Path, summary: Callable[[dict], str]) -> dict | None:
    """Run ``measure``, write its report to ``out`` and print its summary table; None, said on stderr,
    when the benchmark could not run."""
    from openai import APIError

    from meshd.bench.report import write_report

    try:
        report = measure(say)
    except (BenchError, LocalMeshError, APIError) as exc:
        print(f"meshctl bench: {exc}", file=sys.stderr)
        return None
    write_report(out, report)
    say(f"wrote {out}")
    print(summary(report))
    return report


SPEED_CHECK_TIMEOUT_S = 120.0


def wait_for_speed_checks(entry: LocalPeer, say: Say) -> None:
    """Wait until the entry has timed the hops its first route uses: those checks are real decode
    steps on the hops' compute threads, and runs measured while they go on measure them too."""
    deadline = time.monotonic() + SPEED_CHECK_TIMEOUT_S
    while entry.get("/status").get("speed_checks", {}).get("pending", 0):
        if time.monotonic() > deadline:
            say(f"note: the entry's speed checks of its hops still run after {SPEED_CHECK_TIMEOUT_S:.0f}s")
            return
        time.sleep(0.2)


def main_bench(cfg: BenchConfig, out: Path) -> int:
    """The ``meshctl bench`` command: run, write the JSON, print the table; 1 if tokens differ."""
    from meshd.bench.report import format_gguf_summary, format_summary

    report = written_report(lambda s: run_bench(cfg, s), out,
                            lambda r: format_gguf_summary(r) if r.get("format") == "gguf" else format_summary(r))
    if report is None:
        return 1
    if not report["split_identical"] or not report.get("float32", report)["split_identical"]:
        print("meshctl bench: the meshes' tokens differ from one split to another", file=sys.stderr)
        return 1
    if report.get("format") != "gguf" and not report["tokens_identical"] and report["dtype"] == "float32":
        print("meshctl bench: the mesh's tokens differ from the baseline's", file=sys.stderr)
        return 1
    for label, link in report.get("links", {}).items():
        for variant in link["meshes"]:
            if not variant["split_identical"] or (not variant["tokens_identical"] and report["dtype"] == "float32"):
                print(f"meshctl bench: on link {label}, the mesh's tokens differ", file=sys.stderr)
                return 1
    return 0
