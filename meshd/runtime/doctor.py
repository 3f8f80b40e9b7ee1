"""Checks that a loaded shard computes, before anyone is routed to it: the doctor fails closed.

A shard is served only after it passed: every weight it holds is finite, and a canonical input (a
fixed prompt on the head, fixed hidden states elsewhere) goes through every owned layer, a prefill
chunk and then one decode step, with outputs of the right shape and finite. Loading itself already
refused a truncated file, a missing tensor, a config that does not match the weights and bytes that
do not match the manifest. ``meshctl doctor`` runs the same checks on a model directory and a range
without a daemon, and reports what a card would say.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from meshd.errors import ErrorCode, MeshError
from meshd.models.text import TextCodec
from meshd.runtime.backends import open_shard
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard
from meshd.runtime.speed_probe import measure_decode_tok_s
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling

CANONICAL_TOKENS = 8


class ShardCheckFailed(MeshError):
    """The shard does not compute what it should; it is not served."""

    code = ErrorCode.BAD_MODEL


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def check_shard(shard: Shard, checks: list[Check] | None = None) -> list[Check]:
    """Run the checks, appending each to ``checks`` as it ends (so a report keeps the ones before a
    failure, and the failure itself); raises :class:`ShardCheckFailed` naming the first that failed."""
    checks = [] if checks is None else checks
    bad, count = [], 0
    for name, tensor in shard.weight_tensors():
        count += 1
        if not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    checks.append(Check("weights are finite", not bad, f"not finite: {', '.join(bad[:5])}" if bad else
                        f"{count} tensors"))
    if bad:
        raise ShardCheckFailed(f"weights that are not finite: {', '.join(bad[:5])}")
    spec = shard.spec
    session = f"doctor-{os.getpid()}-{time.monotonic_ns()}"
    gen = torch.Generator().manual_seed(1234)

    def bundle(position: int, n: int, phase: Phase) -> HiddenStateBundle:
        if spec.is_head:
            tensors = {INPUT_IDS: torch.randint(0, spec.vocab_size, (n,), generator=gen)}
        else:
            tensors = {HIDDEN_STATES: torch.randn(n, spec.hidden_size, generator=gen).to(spec.dtype)}
        return HiddenStateBundle(session_id=session, epoch=0, phase=phase, start_position=position, token_count=n,
                                 tensors=tensors, range_start=spec.start, range_end=spec.end, sample=True,
                                 sampling=Sampling() if position == 0 else None)

    kept_logits, shard.keep_logits = shard.keep_logits, True
    try:
        for label, step in (("a prefill chunk", bundle(0, CANONICAL_TOKENS, Phase.PREFILL)),
                            ("a decode step", bundle(CANONICAL_TOKENS, 1, Phase.DECODE))):
            try:
                result = shard.forward(step)
            except MeshError:
                raise
            except Exception as exc:  # weights that load but do not compute together (shapes config.json hides)
                checks.append(Check(f"{label} through layers [{spec.start}, {spec.end})", False,
                                    f"{type(exc).__name__}: {exc}"))
                raise ShardCheckFailed(f"{label} through layers [{spec.start}, {spec.end}) failed: "
                                       f"{type(exc).__name__}: {exc}") from None
            if spec.is_tail:
                ok = result.token is not None and 0 <= result.token < spec.vocab_size
                detail = "finite logits, a token in the vocabulary" if ok else f"token {result.token}"
                if result.logits is None or not bool(torch.isfinite(result.logits).all()):
                    ok, detail = False, "logits are not finite"
            else:
                hidden = result.hidden_states
                expected = (step.token_count, spec.hidden_size)
                ok = hidden is not None and tuple(hidden.shape) == expected and bool(torch.isfinite(hidden).all())
                detail = ("hidden states of the right shape, finite" if ok else
                          "no hidden states" if hidden is None else
                          f"shape {list(hidden.shape)} (expected {list(expected)})"
                          if tuple(hidden.shape) != expected else "hidden states are not finite")
            checks.append(Check(f"{label} through layers [{spec.start}, {spec.end})", ok, detail))
            if not ok:
                raise ShardCheckFailed(f"{label} through layers [{spec.start}, {spec.end}): {detail}")
    finally:
        shard.keep_logits = kept_logits
        shard.release(session, 0)
    return checks


@dataclass
class DoctorReport:
    model_dir: str
    layers: tuple[int, int]
    ok: bool = False
    error: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "error": self.error or None, "model_dir": self.model_dir, "layers": list(self.layers),
                **self.model, "checks": [c.__dict__ for c in self.checks]}


def run_doctor(model_path: Path, layers: tuple[int, int] | None, dtype: str, device: str,
               say: Any = None, backend: str = "auto") -> DoctorReport:
    """Describe, load and check one range of a model (a directory or a GGUF file), as a peer would
    before serving it."""
    from meshd.models.gguf_model import default_cache_root, model_directory
    from meshd.runtime.manifest import env_cache_dir
    from meshd.runtime.model_info import choose_numerics, describe_model

    report = DoctorReport(str(model_path), layers or (0, 0))
    try:
        model_dir, model_id = model_directory(model_path, default_cache_root())
        choice = choose_numerics(model_dir, dtype, device, backend=backend)
        info = describe_model(model_dir, model_id, numerics=choice.numerics, say=say, cache_dir=env_cache_dir())
        start, end = layers if layers is not None else (0, info.n_layers)
        report.layers = (start, end)
        report.checks.append(Check("the checkpoint reads and hashes", True,
                                   f"{len(info.manifest.tensors)} tensors, {info.manifest.total_bytes / 1e6:.1f} MB"))
        codec = TextCodec.load(model_dir)  # a peer answers requests with it: one that fails is refused here
        report.checks.append(Check("the tokenizer loads", True, f"{len(codec.tokenizer)} tokens, "
                                   f"{'a' if codec.has_chat_template else 'no'} chat template"))
        rss_before = psutil.Process().memory_info().rss
        started = time.perf_counter()
        shard = open_shard(model_dir, start, end, numerics=info.numerics, manifest=info.manifest, say=say)
        load_s = time.perf_counter() - started
        report.checks.append(Check(f"layers [{start}, {end}) load", True, f"{load_s:.2f}s"))
        check_shard(shard, report.checks)
        report.model = {
            "model_id": info.model_id, "architecture": info.architecture, "n_layers": info.n_layers,
            "backend": info.numerics.backend, "device": info.numerics.device, "dtype": info.numerics.dtype_setting,
            "numerics": info.numerics.name,
            "measured_ms": choice.measured_ms, "compat_key": info.compat_key,
            "parameter_bytes": shard.parameter_bytes(),
            "rss_growth_bytes": psutil.Process().memory_info().rss - rss_before, "load_s": round(load_s, 3),
            "decode_tok_s": round(measure_decode_tok_s(shard), 2),
        }
        report.ok = True
    except MeshError as exc:
        report.error = str(exc)
        report.checks.append(Check("refused", False, str(exc)))
    return report
