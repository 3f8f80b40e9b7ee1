"""A model split into ranges computes exactly what one process computes."""

from __future__ import annotations

import pytest
import torch

from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard
from tests.archs import ARCHS
from tests.helpers import PROMPT, reference_generate

SPLITS = {
    1: [(0, 4)],
    2: [(0, 2), (2, 4)],
    3: [(0, 1), (1, 3), (3, 4)],
    4: [(0, 1), (1, 2), (2, 3), (3, 4)],
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("parts", sorted(SPLITS))
def test_split_generation_matches_single_process(adapter_models, arch, parts):
    model_dir = adapter_models[arch]
    ref_tokens, ref_logits = reference_generate(model_dir, PROMPT, 32)
    chain = LocalChain([Shard(model_dir, s, e, keep_logits=True) for s, e in SPLITS[parts]])
    for chunk in (1, 7, 64):
        out = chain.generate(PROMPT, 32, chunk_tokens=chunk)
        assert out.tokens == ref_tokens, f"chunk={chunk}"
        assert len(out.logits) == len(ref_logits) == 32
        for step, (mine, ref) in enumerate(zip(out.logits, ref_logits, strict=True)):
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-5, msg=f"chunk={chunk} step={step}")
    for shard in chain.shards:
        assert len(shard.kv) == 0, "every session is released after generation"


def test_builtin_tiny_matches_single_process(tiny_model):
    ref_tokens, _ = reference_generate(tiny_model, PROMPT, 32)
    chain = LocalChain([Shard(tiny_model, s, e) for s, e in SPLITS[3]])
    assert chain.generate(PROMPT, 32, chunk_tokens=7).tokens == ref_tokens
