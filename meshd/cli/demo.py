"""The demo: three meshd daemons on loopback split the built-in model and answer an OpenAI client.

Each daemon is its own process and is given the whole model directory but no layer range; the
elected tracker places ranges by the daemons' memory budgets. The reply, streamed through the
official ``openai`` client, is compared token for token with plain single-process generation.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshd.errors import MeshError
from meshd.models.builtin import default_model_dir, ensure_builtin

PROMPT = "Tell me a story about a small machine."
MAX_TOKENS = 48
PEERS = 3


def even_ranges(n_layers: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n_layers / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i] < bounds[i + 1]]


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def run_demo(model_dir: Path | None = None, max_new_tokens: int = MAX_TOKENS) -> int:
    from meshd.daemon.local_mesh import LocalMesh, LocalMeshError, budgets_for_split

    if model_dir is not None and not Path(model_dir).is_dir():
        print(f"demo: {model_dir} is not a model directory", file=sys.stderr)
        return 2
    model_dir = model_dir or ensure_builtin("tiny", default_model_dir("tiny"))
    model_id = Path(model_dir).name
    _say(f"model {model_id} at {model_dir}")
    with tempfile.TemporaryDirectory(prefix="meshd-demo-") as workdir, LocalMesh(Path(workdir)) as mesh:
        try:
            _say(f"starting {PEERS} daemons on loopback (no layer ranges given; the tracker places them)")
            mesh.start_peers([dict(model=model_dir, memory_budget=b) for b in budgets_for_split(model_dir, PEERS)])
            mesh.wait_covered(model_id, timeout=90)
        except (LocalMeshError, MeshError) as exc:  # the daemons, or a model they cannot serve
            print(f"demo: the mesh did not come up: {exc}", file=sys.stderr)
            return 1
        entry = mesh.peers[0]
        for row in entry.get("/peers")["peers"]:
            ranges = ", ".join(f"[{m['start']}, {m['end']})" for m in row["models"])
            role = "tracker" if row["tracker"] else "peer"
            print(f"peer {row['name']} {row['peer_id'][:12]} {role:7} layers {ranges}")
        route = entry.get(f"/route?model={model_id}")
        print("route: " + " -> ".join(f"{h['peer_id'][:12]}[{h['start']},{h['end']})" for h in route["hops"]))

        text, usage, elapsed_decode = _chat(entry.api, model_id, max_new_tokens)
        reference, ref_tokens = _single_process(model_dir, max_new_tokens)
        print(f"prompt: {PROMPT!r}")
        print(f"mesh reply ({usage.completion_tokens} tokens via {entry.api}): {text!r}")
        print(f"single process ({len(ref_tokens)} tokens):          {reference!r}")
        if usage.completion_tokens > 1 and elapsed_decode > 0:
            print(f"decode speed through the mesh: {(usage.completion_tokens - 1) / elapsed_decode:.1f} tokens/s")
        times = mesh.stop()
        _say(f"daemons stopped cleanly in {max(times.values()):.1f}s "
             f"(exit codes {[p.process.returncode for p in mesh.peers]})")
        if text == reference and usage.completion_tokens == len(ref_tokens):
            print(f"identical: {len(ref_tokens)} tokens, token for token")
            return 0
        print("DIFFERENT: the mesh's reply does not reproduce single-process generation")
        return 1


def _chat(api: str, model_id: str, max_new_tokens: int) -> tuple[str, Any, float]:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{api}/v1", api_key="demo", timeout=120, max_retries=0)
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPT}], stream=True, temperature=0,
        max_tokens=max_new_tokens, stream_options={"include_usage": True},
    )
    text, usage, first, last = "", None, None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.monotonic()
            first = first or now
            last = now
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage, (last - first) if first and last else 0.0


def _single_process(model_dir: Path, max_new_tokens: int) -> tuple[str, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    tokens = out[0, len(ids):].tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens
