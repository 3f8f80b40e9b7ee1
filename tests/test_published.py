"""Checkpoints with the published shapes of popular models: written in their layouts, loaded split and
whole, memory proportional to the range held."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from meshd.models.published import PUBLISHED, write_published
from meshd.models.text import TextCodec, ToolFormat
from meshd.runtime.chain import LocalChain
from meshd.runtime.model_info import describe_model
from meshd.runtime.shard import Shard

pytestmark = pytest.mark.slow

MEASURE = r"""
import json, sys, psutil
from meshd.runtime.shard import Shard
base = psutil.Process().memory_info().rss
shard = Shard(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), dtype="auto")
print(json.dumps({"grew": psutil.Process().memory_info().rss - base, "params": shard.parameter_bytes()}))
"""


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_published("qwen2.5-0.5b", tmp_path_factory.mktemp("published") / "qwen2.5-0.5b")


def test_the_layout_is_the_familys(qwen):
    config = json.loads((qwen / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (896, 24, 151936)
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    codec = TextCodec.load(qwen)
    assert codec.stop_token_ids == {151645, 151643} and codec.tool_format == ToolFormat.TAGGED
    ids = codec.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 151644 and codec.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    info = describe_model(qwen)
    assert info.n_layers == 24 and info.dtype == torch.bfloat16 and 0.98e9 < info.manifest.total_bytes < 1e9


def test_memory_follows_the_range_held(qwen):
    def load(start: int, end: int) -> dict[str, int]:
        run = subprocess.run([sys.executable, "-c", MEASURE, str(qwen), str(start), str(end)], capture_output=True,
                             text=True, timeout=300, check=True)
        return json.loads(run.stdout)

    whole, quarter, tail = load(0, 24), load(6, 12), load(18, 24)
    layer_bytes = (whole["params"] - 151936 * 896 * 2 - 896 * 2) / 24  # less the (tied) embedding and final norm
    assert quarter["params"] == pytest.approx(6 * layer_bytes, rel=1e-6)
    assert tail["params"] == pytest.approx(6 * layer_bytes + 151936 * 896 * 2 + 896 * 2, rel=1e-3)
    for measured in (whole, quarter, tail):  # the process grows by what it holds, not by the checkpoint
        assert measured["params"] <= measured["grew"] < measured["params"] + 120e6
    print(f"RSS growth: whole {whole['grew'] / 1e6:.0f} MB, [6,12) {quarter['grew'] / 1e6:.0f} MB, "
          f"[18,24) {tail['grew'] / 1e6:.0f} MB")


def test_a_split_of_the_real_shape_equals_the_whole_bit_for_bit(qwen):
    prompt = TextCodec.load(qwen).encode_chat([{"role": "user", "content": "Say something."}])
    whole = LocalChain([Shard(qwen, 0, 24, dtype="auto", keep_logits=True)]).generate(prompt, 3, chunk_tokens=16)
    split = LocalChain([Shard(qwen, s, e, dtype="auto", keep_logits=True)
                        for s, e in [(0, 9), (9, 17), (17, 24)]]).generate(prompt, 3, chunk_tokens=16)
    assert split.tokens == whole.tokens
    assert all(torch.equal(a, b) for a, b in zip(split.logits, whole.logits, strict=True))


def test_every_published_shape_has_a_config_transformers_reads():
    for shape in PUBLISHED.values():
        config = shape.make_config()
        assert config.architectures[0].endswith("ForCausalLM") and config.num_hidden_layers > 0
