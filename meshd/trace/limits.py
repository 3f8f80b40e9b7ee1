"""The bounds and defaults of trace parity, apart from the code that needs torch (``meshctl`` reads them)."""

from __future__ import annotations

MAX_TRACE_POSITIONS = 2048      # prompt and decode positions of one trace
MAX_TRACE_DECODE_STEPS = 32
MAX_TRACE_REPLY_BYTES = 32 * 1024 * 1024  # what one hop's answer may carry (hidden states, layers, logits)
DEFAULT_DECODE_STEPS = 4
# the default tolerance (relative error) by the class's held dtype; int8 linears keep float32 activations
DEFAULT_TOLERANCE = {"float32": 1e-4, "int8": 1e-3, "float16": 1e-2, "bfloat16": 2e-2}
