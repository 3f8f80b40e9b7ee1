"""The GGUF baseline: llama.cpp itself, the whole model in this process, greedy decoding.

This is what a user of llama.cpp gets from the same file on one machine: the model loaded once,
the prompt decoded as one batch, then one token per call, each the argmax of llama.cpp's logits.
It has the interface of :class:`meshd.bench.baseline.Baseline`, so a GGUF benchmark brackets every
mesh with it exactly as the safetensors benchmark brackets with transformers. Also here: how often
meshd's torch path picks llama.cpp's token, teacher-forced over llama.cpp's own greedy output.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from meshd.bench.baseline import BaselineResult, measure_runs


class LlamaCppBaseline:
    def __init__(self, gguf_path: Path, prompt_ids: list[int], new_tokens: int, threads: int) -> None:
        from meshd.runtime.llamacpp.engine import model_params
        from meshd.runtime.llamacpp.library import library

        lib = library()
        self.lib = lib
        self.threads = threads
        self.model = lib.llama_model_load_from_file(str(gguf_path).encode(), model_params(lib))
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = lib.llama_context_default_params()
        params.n_ctx = len(prompt_ids) + max(new_tokens, 256) + 16
        params.n_batch = params.n_ubatch = max(512, len(prompt_ids))
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.model_bytes = Path(gguf_path).stat().st_size
        self.prompt_ids = list(prompt_ids)
        self.new_tokens = new_tokens
        self.token_ids: list[int] | None = None
        self.generate(min(4, new_tokens))  # warm-up

    def _decode(self, tokens: list[int], start: int) -> int:
        lib = self.lib
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i == len(tokens) - 1 else 0
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama.cpp failed to decode")
        finally:
            lib.llama_batch_free(batch)
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, len(tokens) - 1), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, n: int, stamps: list[float] | None = None) -> list[int]:
        """``n`` greedy tokens after the prompt, from an empty cache; ``stamps`` gets each token's time."""
        self.lib.llama_memory_clear(self.memory, ctypes.c_bool(True))
        token = self._decode(self.prompt_ids, 0)
        out = [token]
        if stamps is not None:
            stamps.append(time.perf_counter())
        while len(out) < n:
            token = self._decode([token], len(self.prompt_ids) + len(out) - 1)
            out.append(token)
            if stamps is not None:
                stamps.append(time.perf_counter())
        return out

    def measure(self, runs: int) -> BaselineResult:
        def once() -> tuple[list[int], list[float], float]:
            stamps: list[float] = []
            started = time.perf_counter()
            return self.generate(self.new_tokens, stamps), stamps, started

        result = measure_runs(once, runs, self.token_ids, self.model_bytes, self.threads)
        self.token_ids = result.token_ids
        return result

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def top1_agreement(model_dir: Path, prompt_ids: list[int], reference: list[int]) -> float:
    """The share of positions where meshd's torch path, fed ``reference`` (llama.cpp's greedy tokens)
    one by one, would have chosen the same next token as llama.cpp did."""
    from meshd.runtime.backends import open_shard
    from meshd.runtime.chain import input_bundles
    from meshd.runtime.model_info import choose_numerics
    from meshd.wire.bundle import Sampling

    numerics = choose_numerics(model_dir, backend="torch").numerics
    shard = open_shard(model_dir, 0, _layers(model_dir), numerics=numerics)
    span = (0, shard.spec.n_layers)
    first = shard.forward(next(input_bundles("agree", 0, prompt_ids, 0, 512, span, Sampling())))
    chosen = [first.token]
    for i, token in enumerate(reference[:-1]):
        step = next(input_bundles("agree", 0, [token], len(prompt_ids) + i, 512, span, Sampling(), i + 1))
        chosen.append(shard.forward(step).token)
    shard.release("agree", 0)
    return sum(a == b for a, b in zip(chosen, reference, strict=True)) / len(reference)


def _layers(model_dir: Path) -> int:
    from meshd.runtime.loader import load_config

    return int(load_config(model_dir).num_hidden_layers)
