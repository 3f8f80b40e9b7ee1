"""The trained built-in models: learnt on the machine, deterministically, from Python's own documentation,
sharing one tokenizer, and scored on text they never saw. The tests train shrunken configurations."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from meshd.cli import meshctl_main
from meshd.models import trained
from meshd.models.builtin import BUILTIN_MODELS, create_builtin, directory_digest, ensure_builtin, make_config
from meshd.models.text import TextCodec
from meshd.models.trained import TRAINING, TrainingConfig, corpus, heldout_perplexity, lr_factor, train
from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard, rows_align
from tests.helpers import reference_generate

SMALL_VOCAB = 512


def small(name: str, steps: int = 30) -> TrainingConfig:
    """``name``'s configuration shrunk to seconds: a narrow model, a small vocabulary, short windows, one
    thread (on a busy machine, two threads wait on each other longer than such small products take)."""
    layers = {"trained": 2, "draft": 1}[name]
    spec = replace(TRAINING[name].spec, hidden_size=64, num_layers=layers, num_heads=2, num_kv_heads=2,
                   intermediate_size=128, vocab_size=SMALL_VOCAB)
    return replace(TRAINING[name], spec=spec, steps=steps, batch_size=4, seq_len=64, warmup_steps=3,
                   threads=1, teacher="")


@pytest.fixture(scope="module")
def small_trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "trained"
    train(small("trained"), out)
    return out


def test_training_gives_the_same_bytes_every_time(small_trained, tmp_path):
    again = tmp_path / "again"
    train(small("trained"), again)
    assert (again / "model.safetensors").read_bytes() == (small_trained / "model.safetensors").read_bytes()
    assert directory_digest(again) == directory_digest(small_trained)
    assert sorted(p.name for p in small_trained.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "training.json"]


def test_loss_falls_and_heldout_perplexity_beats_a_uniform_guess(small_trained):
    record = json.loads((small_trained / "training.json").read_text())
    assert record["train_loss"][-1] < record["train_loss"][0] - 0.5
    ppl = record["heldout"]["perplexity"]
    assert math.isfinite(ppl) and 1 < ppl < SMALL_VOCAB / 2
    assert record["text_source"].startswith("pydoc_data.topics") and record["training"]["seed"] == 3
    again = heldout_perplexity(small_trained, threads=1)
    assert again.perplexity == pytest.approx(ppl, rel=1e-4)
    assert again.tokens == record["heldout"]["tokens"] and 0 < again.bits_per_byte < 8


def test_loads_with_plain_transformers_and_generates_text(small_trained):
    model = AutoModelForCausalLM.from_pretrained(small_trained)
    tok = AutoTokenizer.from_pretrained(small_trained)
    assert len(tok) == model.config.vocab_size == SMALL_VOCAB and model.dtype == torch.float32
    text = "The \"if\" statement is used for conditional execution. héllo ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|begin|><|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = torch.tensor([tok("The statement")["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=model.config.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 8
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


def test_meshd_serves_it_split_as_one_process_computes_it(small_trained):
    codec = TextCodec.load(small_trained)
    assert codec.has_chat_template and codec.stop_token_ids == {1}
    prompt = codec.encode_chat([{"role": "user", "content": "What does the while statement do?"}])
    ref_tokens, _ = reference_generate(small_trained, prompt, 16)
    chain = LocalChain([Shard(small_trained, 0, 1), Shard(small_trained, 1, 2)])
    assert chain.generate(prompt, 16, chunk_tokens=7).tokens == ref_tokens


def test_the_draft_shares_the_tokenizer_and_is_smaller(small_trained, tmp_path):
    draft = tmp_path / "draft"
    train(small("draft", steps=2), draft)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft / name).read_bytes() == (small_trained / name).read_bytes(), name
    params = {d: json.loads((d / "training.json").read_text())["parameters"] for d in (draft, small_trained)}
    assert params[draft] < params[small_trained]


def test_a_draft_taught_by_its_target_learns_the_target_s_choices(small_trained, tmp_path):
    """Trained on the target's distribution, the draft agrees with its greedy choices more often than a
    draft trained as long on the text alone; a teacher with another tokenizer is refused."""
    from tokenizers import Tokenizer

    heldout = trained.token_stream(Tokenizer.from_file(str(small_trained / "tokenizer.json")), corpus().heldout)
    ids = torch.tensor(heldout[:512])[None]
    target = AutoModelForCausalLM.from_pretrained(small_trained).eval()
    agreement = {}
    for taught in (False, True):
        out = tmp_path / f"draft-{taught}"
        train(small("draft", steps=60), out, teacher=small_trained if taught else None)
        draft = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            agreement[taught] = float((draft(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean())
    assert agreement[True] > agreement[False], agreement
    other = tmp_path / "other-tokenizer"
    shutil.copytree(small_trained, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<|pad|>"', '"<|pads|>"'))
    with pytest.raises(ValueError, match="tokenizer"):
        train(small("draft", steps=1), tmp_path / "refused", teacher=other)


def test_the_full_models_have_batchable_shapes_and_a_tenfold_size_ratio():
    counts = {}
    for name, cfg in TRAINING.items():
        config = make_config("llama", cfg.spec)
        assert BUILTIN_MODELS[name].trained and rows_align(config)
        head_dim = config.hidden_size // config.num_attention_heads
        widths = (config.hidden_size, config.intermediate_size, config.num_key_value_heads * head_dim)
        assert all(w % 64 == 0 for w in widths) and head_dim % 16 == 0, name
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert 8 < counts["trained"] / counts["draft"] < 16
    assert TRAINING["draft"].spec.vocab_size == TRAINING["trained"].spec.vocab_size


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    cfg = TRAINING["trained"]
    factors = [lr_factor(cfg, s) for s in range(cfg.steps)]
    assert factors[0] < 0.1 and max(factors) == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(cfg.min_lr_ratio, abs=1e-3)
    peak = factors.index(max(factors))
    assert all(a >= b for a, b in zip(factors[peak:], factors[peak + 1:], strict=False))


def test_the_heldout_text_is_a_fixed_tail_never_trained_on():
    text = corpus()
    assert text == corpus()
    held, total = sum(map(len, text.heldout)), sum(map(len, text.train + text.heldout))
    assert 0.04 < held / total < 0.06
    assert not any(doc in text.heldout for doc in text.train)
    assert text.heldout[0] not in "".join(text.train)


def test_create_builtin_trains_into_a_staged_directory_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(trained.TRAINING, "draft", small("draft", steps=2))
    out = tmp_path / "models" / "draft"
    with pytest.raises(SystemExit) as exit_:
        meshctl_main.main(["model", "create", "draft", "--out", str(out)])
    assert exit_.value.code == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out) and "held-out perplexity" in captured.err
    assert sorted(p.name for p in out.parent.iterdir()) == ["draft"], "no staging directory is left behind"
    assert AutoConfig.from_pretrained(out).tie_word_embeddings
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("draft", out) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError):
        create_builtin("draft", out)
