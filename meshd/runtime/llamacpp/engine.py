"""One layer range computed by llama.cpp: hidden states in, hidden states (or logits) out, KV kept
per sequence.

The range's GGUF (:mod:`meshd.runtime.llamacpp.range_file`) is loaded as a model of its own and fed
input embeddings: the hidden states from the hop before, or the head's token embeddings (looked up
here from the GGUF's embedding matrix, so that every range takes the same kind of input and a split
run equals the whole one). A range before the tail reads its last block's output (the tensor
llama.cpp names ``l_out-N``) through the evaluation callback, which llama.cpp asks about every node of
the graph and which copies that one node's data out. Each session of the shard is one llama.cpp
sequence of a single context whose KV cells all sequences share; positions are given explicitly, so
a sequence continues exactly where the shard says it stands.

All calls run on the shard's compute thread. Sequences the event loop lets go of (a session
released or evicted) are only queued here and dropped on the compute thread before the next step.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshd.errors import BundleError, KVBudgetExceeded, ModelFormatError
from meshd.runtime.cpu_info import cpu_flags
from meshd.runtime.llamacpp.library import ggml, library

MAX_SEQUENCES = 64


@dataclass(frozen=True)
class EngineOptions:
    n_ctx: int = 8192          # KV cells shared by every sequence
    n_batch: int = 512         # the most tokens one call may carry
    threads: int = 0           # 0: llama.cpp's default (its count of physical cores)
    gpu_layers: int = 0        # layers to offload when the build has a GPU backend


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles. llama.cpp then holds quantized weights in its AMX buffer type,
    whose kernels crashed (SIGSEGV in the first decode of a q8_0 range) on such a machine, a virtual
    one that grants the tile state; there, weights stay in plain CPU buffers."""
    return "amx_int8" in cpu_flags()


def model_params(lib: Any, gpu_layers: int = 0) -> Any:
    """llama.cpp's model parameters as meshd loads every model: ``gpu_layers`` offloaded, and no AMX
    buffers where they crash (:func:`cpu_has_amx`)."""
    params = lib.llama_model_default_params()
    params.n_gpu_layers = gpu_layers
    params.use_extra_bufts = not cpu_has_amx()
    return params


class RangeEngine:
    def __init__(self, path: Path, n_layers: int, is_tail: bool, options: EngineOptions) -> None:
        lib = library()
        self.lib = lib
        self.is_tail = is_tail
        self.n_layers = n_layers
        self.options = options
        model = lib.llama_model_load_from_file(str(path).encode(), model_params(lib, options.gpu_layers))
        if not model:
            raise ModelFormatError(f"llama.cpp could not load {Path(path).name} (see the log above)")
        self.model = model
        self.n_embd = int(lib.llama_model_n_embd(model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
        cp = lib.llama_context_default_params()
        cp.n_ctx = options.n_ctx
        cp.n_batch = options.n_batch
        cp.n_ubatch = options.n_batch
        cp.n_seq_max = MAX_SEQUENCES
        cp.kv_unified = True
        if options.threads:
            cp.n_threads = options.threads
            cp.n_threads_batch = options.threads
        self._out_name = f"l_out-{n_layers - 1}".encode()
        self._captured: np.ndarray | None = None
        self._callback: Any = None
        if not is_tail:
            accessors = ggml()
            out_name = self._out_name

            @lib.ggml_backend_sched_eval_callback
            def capture(tensor: int, ask: bool, _user_data: Any) -> bool:
                is_output = accessors.name(tensor) == out_name
                if ask:
                    return is_output
                if is_output:
                    buffer: np.ndarray = np.empty(accessors.nbytes(tensor) // 4, dtype=np.float32)
                    accessors.read(tensor, buffer)
                    self._captured = buffer
                return True

            self._callback = capture  # kept alive as long as the context
            cp.cb_eval = capture
        ctx = lib.llama_init_from_model(model, cp)
        if not ctx:
            lib.llama_model_free(model)
            raise ModelFormatError(f"llama.cpp could not create a context for {Path(path).name}")
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        self._free_ids = list(range(MAX_SEQUENCES - 1, -1, -1))
        self._owner = threading.get_ident()  # the compute thread: the only one that calls into llama.cpp
        self._pending: list[tuple[int, int]] = []  # (sequence, keep this many positions; -1: release)
        self._lock = threading.Lock()

    # -- sequences ---------------------------------------------------------------------------------

    def new_sequence(self) -> int:
        self._apply_pending()
        if not self._free_ids:
            raise KVBudgetExceeded(f"all {MAX_SEQUENCES} llama.cpp sequences of this shard are in use")
        return self._free_ids.pop()

    def release(self, seq: int) -> None:
        """Let a sequence go (from any thread; applied on the compute thread before the next step)."""
        self._schedule(seq, -1)

    def truncate(self, seq: int, length: int) -> None:
        """Forget the sequence's positions from ``length`` on: a failed step undone, or a session resumed
        with fewer tokens (from any thread, as :meth:`release`)."""
        self._schedule(seq, length)

    def _schedule(self, seq: int, keep: int) -> None:
        with self._lock:
            self._pending.append((seq, keep))
        if threading.get_ident() == self._owner:
            self._apply_pending()

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for seq, keep in pending:
            if keep < 0:
                self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
                self._free_ids.append(seq)
            else:
                self.lib.llama_memory_seq_rm(self.memory, seq, keep, -1)

    # -- compute -----------------------------------------------------------------------------------

    def run(self, seq: int, inputs: np.ndarray, start: int, want_logits: bool) -> np.ndarray:
        """Compute ``inputs`` (``[n, n_embd]`` float32, positions ``start ..``) for ``seq``; the range's
        output rows ``[n, n_embd]``, or on the tail the last row's logits ``[n_vocab]``."""
        self._apply_pending()
        lib = self.lib
        rows = np.ascontiguousarray(inputs, dtype=np.float32)
        n = rows.shape[0]
        if n > self.options.n_batch:
            raise BundleError(f"{n} tokens exceed the engine's batch of {self.options.n_batch}")
        batch = lib.llama_batch_init(n, self.n_embd, 1)
        try:
            ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
            batch.n_tokens = n
            for i in range(n):
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                # before the tail every row is an output: llama.cpp's last block computes only those
                batch.logits[i] = 1 if (not self.is_tail or i == n - 1) else 0
            self._captured = None
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            self.truncate(seq, start)
            if rc == 1:
                raise KVBudgetExceeded(f"llama.cpp has no free KV cells for {n} more tokens "
                                       f"({self.options.n_ctx} cells in all)")
            raise BundleError(f"llama.cpp failed to compute the step (code {rc})")
        if self.is_tail:
            if not want_logits:
                return np.empty((0,), dtype=np.float32)
            logits = lib.llama_get_logits_ith(self.ctx, n - 1)
            return np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()
        if self._captured is None or self._captured.size != n * self.n_embd:
            self.truncate(seq, start)
            raise BundleError(f"llama.cpp gave no output of block {self.n_layers - 1} for the step")
        return self._captured.reshape(n, self.n_embd)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the library may be gone
            self.close()
