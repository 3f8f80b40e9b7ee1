"""Reference runs for the tests: plain single-process transformers generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from meshd.runtime.numerics import Numerics, onednn_available

_MODELS: dict[Path, torch.nn.Module] = {}

# fp32 linears through oneDNN, decode in its band of two rows and more (meshd.runtime.numerics)
ONEDNN = Numerics(torch.float32, prefill_onednn=True, decode_onednn=True, decode_rows=2, decode_max_rows=32)
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear here")


def fail_at_layer(monkeypatch, shard, index: int) -> None:
    """Make ``shard`` raise "kernel failed" whenever it computes layer ``index`` (until monkeypatch undoes it)."""
    run_layer = shard._run_layer

    def failing(at, *args):
        if at == index:
            raise RuntimeError("kernel failed")
        return run_layer(at, *args)

    monkeypatch.setattr(shard, "_run_layer", failing)


def reference_model(model_dir: Path):
    if model_dir not in _MODELS:
        # eager attention: the unambiguous reference (sdpa would skip Gemma 2's attention soft cap)
        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        _MODELS[model_dir].generation_config.eos_token_id = None  # run to max_new_tokens, always
    return _MODELS[model_dir]


def reference_generate(model_dir: Path, prompt: list[int], max_new_tokens: int):
    """Greedy ``generate()`` with KV cache and no early stop: (tokens, per-step logits)."""
    model = reference_model(model_dir)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id,
        return_dict_in_generate=True, output_logits=True,
    )
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = [step[0] for step in out.logits]
    return tokens, logits


PROMPT = [0, 3, 16, 78, 107, 114, 114, 117, 38, 122, 110, 107, 120, 107, 50, 38, 115, 107, 121, 110, 39, 1, 16,
          4, 16, 201, 33, 150, 12, 90, 91, 92, 93]


def chat_reference(model_dir: Path, question: str, max_new_tokens: int) -> str:
    """What single-process greedy generation answers to one user message (no early stop)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = reference_generate(model_dir, list(prompt), max_new_tokens)
    return tok.decode(tokens, skip_special_tokens=True)


async def join_mesh(transport, admitter) -> object:
    """Redeem a fresh invite from ``admitter`` (a LocalPeer holding the admission key) over
    ``transport``, as ``meshd join`` does, and show the credential on every stream it opens from then
    on; returns the credential."""
    from meshd.admission import MeshGate, parse_token
    from meshd.rpc import call
    from meshd.wire import admission_pb2 as apb
    from meshd.wire import rpc_pb2 as rpb

    signed, _ = parse_token(admitter.invite())
    request = rpb.PeerRequest(join=apb.JoinRequest(invite=signed))
    reply = await call(transport, admitter.peer_id, admitter.listen, request, timeout=10)
    membership = reply.joined.membership
    transport.stream_headers.update(MeshGate(b"", transport.identity.peer_id, own=membership).header())
    return membership


def api_chat(peer, content: str = "hello", max_tokens: int = 8, **extra) -> str:
    """One greedy chat completion of the built-in ``tiny`` model through ``peer``'s OpenAI API."""
    import httpx2 as httpx

    reply = httpx.post(f"http://{peer.api}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def metric_total(peer, family: str, label: str) -> float:
    """The sum of a counter family's ``_total`` samples carrying ``label`` (``name="value"``)."""
    import httpx2 as httpx

    text = httpx.get(f"http://{peer.status['metrics']}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family + "_total") and label in line)
