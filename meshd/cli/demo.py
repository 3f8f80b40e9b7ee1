"""The demo: one chat prompt through the model split into three ranges, against one process."""

from __future__ import annotations

import os
from pathlib import Path

from meshd.models.builtin import default_model_dir, ensure_builtin

PROMPT = "Tell me a story about a small machine."


def even_ranges(n_layers: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n_layers / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i] < bounds[i + 1]]


def run_demo(model_dir: Path | None = None, max_new_tokens: int = 48) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from meshd.runtime.chain import LocalChain
    from meshd.runtime.shard import Shard

    model_dir = model_dir or ensure_builtin("tiny", default_model_dir("tiny"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    print(f"model: {model_dir}")
    print(f"prompt: {PROMPT!r} ({len(prompt_ids)} tokens)")

    shards = [Shard(model_dir, s, e) for s, e in even_ranges(Shard(model_dir, 0, 1).spec.n_layers, 3)]
    ranges = ", ".join(f"[{s.spec.start}, {s.spec.end})" for s in shards)
    chain = LocalChain(shards)
    eos = tokenizer.eos_token_id
    split = chain.generate(prompt_ids, max_new_tokens, eos_token_id=eos, chunk_tokens=16)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id)
    out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    single = out[0, len(prompt_ids):].tolist()

    print(f"split into 3 ranges {ranges}: {tokenizer.decode(split.tokens, skip_special_tokens=True)!r}")
    print(f"single process:             {tokenizer.decode(single, skip_special_tokens=True)!r}")
    if split.tokens == single:
        print(f"identical: {len(single)} tokens, token for token")
        return 0
    print("DIFFERENT: the split run does not reproduce single-process generation")
    return 1
