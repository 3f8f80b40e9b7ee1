"""The built-in models trained on the machine: ``trained`` and its speculative draft ``draft``.

Random weights make every quality figure meaningless: a draft of a random model is accepted by
chance, and a quantized random model is "as good" as any other. These two models learn English from
the documentation that ships with Python itself (``pydoc_data.topics``: the language reference's
topics, about 460 KB), so nothing is downloaded. The topics are read in name order; the last 5 % of
the text, cut at a paragraph break, is held out and never trained on, so :func:`heldout_perplexity`
can score any model with their tokenizer (a quantized copy against float32, the draft against its
target). Both models share one byte-level BPE tokenizer learnt from the training text, with the
built-in models' special tokens at the same ids, so a draft's token ids mean what the target's mean.

Determinism: the tokenizer trainer is deterministic for byte-level BPE; weights are initialised,
batches drawn and the optimiser run under fixed seeds, a fixed thread count (2, whatever the
machine) and ``torch.use_deterministic_algorithms``, always on the CPU. The same code, Python and
torch give the same bytes on the same machine (a different CPU may round a matrix product
differently). ``training.json`` records how the model was made and what it scores; the wall time is
reported, not written, so that the directory stays byte-identical.

With the configuration below both models together trained in about 264 s on the 2-core development
machine (the draft learns from ``trained``, so ``trained`` comes first).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from meshd.models.builtin import BUILTIN_MODELS, BuiltinSpec, make_config, write_metadata
from meshd.models.tokenizer import BOS, BUILTIN_LAYOUT, EOS, train_tokenizer
from meshd.progress import progress as progress_of

TEXT_SOURCE = "pydoc_data.topics"
HELDOUT_FRACTION = 0.05
HELDOUT_WINDOW = 256  # tokens per scored window: the models' training context
TRAINING_FILE = "training.json"

Say = Callable[[str], None]
Forward = Callable[[torch.Tensor], torch.Tensor]  # token ids [1, n] -> logits [1, n, vocab]


@dataclass(frozen=True)
class TrainingConfig:
    """How one model is trained; tests shrink it (fewer steps, a smaller ``spec``)."""

    spec: BuiltinSpec        # shape, seed and vocabulary size (the tokenizer's)
    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float = 0.1   # the cosine schedule ends at this fraction of the peak rate
    weight_decay: float = 0.1   # on matrices only, not on norms
    grad_clip: float = 1.0
    # The (tied) embedding learns this many times faster than the matrices: a wider model needs a lower
    # rate for its matrices, not for its embedding, and at their rate the token statistics came slowest
    # (``trained``: held-out perplexity 69 at 1x, 51 at 3x, 47 at 10x, in 400 steps of 16 x 128 tokens).
    embedding_lr_scale: float = 1.0
    threads: int = 2
    teacher: str = ""  # a built-in model to learn from: match its next-token distribution (a draft's target)


TRAINING: dict[str, TrainingConfig] = {
    "draft": TrainingConfig(BUILTIN_MODELS["draft"], steps=500, batch_size=8, seq_len=256, learning_rate=3e-3,
                            warmup_steps=25, embedding_lr_scale=3.0, teacher="trained"),
    "trained": TrainingConfig(BUILTIN_MODELS["trained"], steps=500, batch_size=8, seq_len=256, learning_rate=1e-3,
                              warmup_steps=25, embedding_lr_scale=10.0),
}
assert sorted(TRAINING) == sorted(n for n, s in BUILTIN_MODELS.items() if s.trained)
assert len({c.spec.vocab_size for c in TRAINING.values()}) == 1, "the draft and its target share one tokenizer"


@dataclass(frozen=True)
class Corpus:
    train: tuple[str, ...]    # documents, in order
    heldout: tuple[str, ...]
    sha256: str               # of every document in order, so a report names exactly the text read

    @property
    def source(self) -> str:
        return f"{TEXT_SOURCE} (Python {platform.python_version()})"


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    tokens: int          # tokens scored
    text_bytes: int      # UTF-8 bytes of the text scored
    nll: float           # summed negative log-likelihood, nats
    window: int          # tokens of context at most

    @property
    def bits_per_byte(self) -> float:
        """Comparable across tokenizers, unlike the perplexity."""
        return self.nll / math.log(2) / self.text_bytes

    def as_json(self) -> dict[str, Any]:
        return {"perplexity": round(self.perplexity, 4), "bits_per_byte": round(self.bits_per_byte, 4),
                "tokens": self.tokens, "window": self.window}


@dataclass(frozen=True)
class TrainingReport:
    name: str
    parameters: int
    steps: int
    loss_first: float     # mean training loss over the first tenth of the steps
    loss_last: float      # and over the last tenth
    heldout: Perplexity
    seconds: float


def corpus() -> Corpus:
    """The text both models learn from, split into training and held-out documents."""
    from pydoc_data.topics import topics

    docs = [topics[key].strip() for key in sorted(topics)]
    digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()
    cut = int(sum(len(d) for d in docs) * (1 - HELDOUT_FRACTION))
    for i, doc in enumerate(docs):
        if cut < len(doc):
            at = doc.rfind("\n\n", 0, cut)
            head, tail = (doc[:at], doc[at:].lstrip("\n")) if at > 0 else ("", doc)
            return Corpus(tuple([*docs[:i], head] if head else docs[:i]), tuple([tail, *docs[i + 1:]]), digest)
        cut -= len(doc)
    raise AssertionError("the held-out fraction leaves no text")


def token_stream(tokenizer: Tokenizer, docs: Sequence[str]) -> list[int]:
    """The begin token, then every document followed by the end token: the models learn to stop."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if bos is None or eos is None:
        raise ValueError(f"the tokenizer has no {BOS} or {EOS}: not the built-in models' tokenizer")
    ids = [bos]
    for encoding in tokenizer.encode_batch(list(docs)):
        ids += [*encoding.ids, eos]
    return ids


def perplexity_of(forward: Forward, ids: Sequence[int], text_bytes: int, window: int = HELDOUT_WINDOW) -> Perplexity:
    """Score ``ids`` with any model's ``forward`` (transformers, a mesh, llama.cpp) in consecutive windows
    of ``window`` tokens, each predicting its own tokens: every token but the first is scored once."""
    ids_t = torch.tensor(list(ids), dtype=torch.long)
    nll, scored = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids_t) - 1, window):
            chunk = ids_t[start:start + window + 1]
            logits = forward(chunk[None, :-1])[0].float()
            nll += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
            scored += len(chunk) - 1
    return Perplexity(perplexity=math.exp(nll / scored), tokens=scored, text_bytes=text_bytes, nll=nll, window=window)


def heldout_perplexity(model_dir: Path, window: int = HELDOUT_WINDOW, dtype: torch.dtype = torch.float32,
                       threads: int = 2, int8: bool = False) -> Perplexity:
    """The held-out perplexity of the model in ``model_dir``, which must have the trained models'
    tokenizer (``trained``, ``draft``, or a converted or quantized copy of either); with ``int8``, its
    linears computed as at ``--dtype int8`` (:mod:`meshd.runtime.int8`)."""
    model_dir = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    heldout = corpus().heldout
    ids = token_stream(tokenizer, heldout)
    with _deterministic(seed=0, threads=threads):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if int8:
            from meshd.runtime.int8 import quantize_linears

            quantize_linears(model)
        model.eval()
        return perplexity_of(lambda x: model(x).logits, ids, _utf8_bytes(heldout), window)


def train_builtin(name: str, out_dir: Path, progress: Say | None = None) -> TrainingReport:
    """Train the built-in model ``name`` into ``out_dir`` (the caller stages the directory); its teacher,
    if it has one, is created first where built-in models live."""
    config = TRAINING[name]
    teacher = None
    if config.teacher:
        from meshd.models.builtin import default_model_dir, ensure_builtin

        teacher = ensure_builtin(config.teacher, default_model_dir(config.teacher), progress)
    return train(config, out_dir, progress, teacher)


def train(config: TrainingConfig, out_dir: Path, progress: Say | None = None,
          teacher: Path | None = None) -> TrainingReport:
    """Train one model as ``config`` says and write it, with ``training.json``, into ``out_dir``.

    With ``teacher`` (a model directory with the same tokenizer), the model learns the teacher's
    next-token distribution (the KL divergence from it) instead of the text's next token: a draft
    trained so guesses what its target would say, which is what speculative decoding accepts."""
    say = progress or (lambda _msg: None)
    spec = config.spec
    started = time.monotonic()
    text = corpus()
    tokenizer = train_tokenizer(text.train, spec.vocab_size, BUILTIN_LAYOUT)
    train_ids = torch.tensor(token_stream(tokenizer, text.train), dtype=torch.long)
    heldout_ids = token_stream(tokenizer, text.heldout)
    if len(train_ids) <= config.seq_len + 1:
        raise ValueError(f"{len(train_ids)} training tokens do not fill one window of {config.seq_len}")
    say(f"{spec.name}: {len(train_ids)} training and {len(heldout_ids)} held-out tokens of {text.source}")
    hf_config = make_config("llama", spec)

    with _deterministic(spec.seed, config.threads):
        teacher_model = None
        if teacher is not None:
            if Tokenizer.from_file(str(Path(teacher) / "tokenizer.json")).to_str() != tokenizer.to_str():
                raise ValueError(f"the teacher {teacher} does not share this model's tokenizer")
            teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
        model = AutoModelForCausalLM.from_config(hf_config).float()
        parameters = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight
        matrices = [p for p in model.parameters() if p.ndim >= 2 and p is not embedding]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": config.weight_decay},
             {"params": [embedding], "weight_decay": config.weight_decay,
              "lr": config.learning_rate * config.embedding_lr_scale},
             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
            lr=config.learning_rate, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(config, step))
        batches = torch.Generator().manual_seed(spec.seed)
        window = torch.arange(config.seq_len + 1)
        losses: list[float] = []
        model.train()
        with progress_of(f"training {spec.name} ({parameters:,} parameters)", config.steps, "steps",
                         say=say) as bar:
            for _ in range(config.steps):
                starts = torch.randint(0, len(train_ids) - config.seq_len - 1, (config.batch_size, 1),
                                       generator=batches)
                batch = train_ids[starts + window]
                logits = model(batch[:, :-1]).logits
                if teacher_model is None:
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             batch[:, 1:].reshape(-1))
                else:
                    with torch.no_grad():
                        target = torch.log_softmax(teacher_model(batch[:, :-1]).logits, dim=-1)
                    loss = torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1).reshape(-1, logits.shape[-1]),
                                                      target.reshape(-1, logits.shape[-1]), log_target=True,
                                                      reduction="batchmean")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                optimizer.step()
                schedule.step()
                losses.append(float(loss.detach()))
                bar.advance(note=f"loss {losses[-1]:.3f}")
        model.eval()
        heldout = perplexity_of(lambda x: model(x).logits, heldout_ids, _utf8_bytes(text.heldout))

    tenth = max(1, len(losses) // 10)
    curve = [round(sum(part) / len(part), 4) for part in _tenths(losses)]
    record = {
        "model": spec.name,
        "text_source": text.source,
        "text_sha256": text.sha256,
        "heldout_fraction": HELDOUT_FRACTION,
        "train_tokens": len(train_ids),
        "parameters": parameters,
        "tokens_seen": config.steps * config.batch_size * config.seq_len,
        "training": {k: v for k, v in asdict(config).items() if k != "spec"} | {"seed": spec.seed},
        "train_loss": curve,
        "heldout": heldout.as_json(),
        "torch": torch.__version__,
    }
    write_metadata(out_dir, hf_config, torch.float32, BUILTIN_LAYOUT, tokenizer)
    state = model.state_dict()
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({name: state[name].detach().contiguous() for name in sorted(state)},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / TRAINING_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    report = TrainingReport(name=spec.name, parameters=parameters, steps=config.steps,
                            loss_first=sum(losses[:tenth]) / tenth, loss_last=sum(losses[-tenth:]) / tenth,
                            heldout=heldout, seconds=time.monotonic() - started)
    say(f"{spec.name}: training loss {report.loss_first:.3f} -> {report.loss_last:.3f}, held-out perplexity "
        f"{heldout.perplexity:.2f} ({heldout.bits_per_byte:.3f} bits per byte, {heldout.tokens} tokens), "
        f"{report.seconds:.0f} s")
    return report


def lr_factor(config: TrainingConfig, step: int) -> float:
    """Linear warm-up, then a cosine from the peak rate down to ``min_lr_ratio`` of it."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def _tenths(values: list[float]) -> Iterator[list[float]]:
    parts = min(10, len(values))
    for i in range(parts):
        yield values[i * len(values) // parts:(i + 1) * len(values) // parts]


def _utf8_bytes(docs: Sequence[str]) -> int:
    return sum(len(d.encode()) for d in docs)


@contextmanager
def _deterministic(seed: int, threads: int) -> Iterator[None]:
    """Seeded, deterministic torch on ``threads`` threads; the process's settings and random state are
    restored afterwards (set_num_threads and the deterministic flag are process-wide)."""
    threads_before = torch.get_num_threads()
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    warn_only_before = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic_before, warn_only=warn_only_before)
        torch.set_num_threads(threads_before)
