"""Fixtures: tiny BPE tokenizers trained here on the repository's data/ text, tiny Llama models, and fakes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[1] / "data"  # the repository's own copy: nothing outside it is read


def pytest_configure(config):
    pin_xdist_worker()


def pytest_collection_modifyitems(config, items):
    """The README's install first (the longest test), then real-model tests (their order kept): the
    two workers then end on short tests together (`make test` lets an idle one take a busy one's
    queue: `--dist worksteal`), rather than one waiting while the other runs the last long one."""
    items.sort(
        key=lambda item: (item.get_closest_marker("install") is None, item.get_closest_marker("real") is None)
    )


def pin_xdist_worker() -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker keeps to its own share of the
    CPUs, and so do torch and llama.cpp (its threads follow the affinity): unpinned, two workers'
    spinning llama.cpp threads oversubscribe the cores and stall. vLLM binds its own threads: its
    tests are marked `exclusive` and run after, in one unpinned process."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    )
    cpus = sorted(os.sched_getaffinity(0))
    if not worker or count < 2 or len(cpus) < 2:
        return
    index = int(worker.removeprefix("gw"))
    share = cpus[index::count] or [cpus[index % len(cpus)]]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))
    os.environ["OMP_NUM_THREADS"] = str(len(share))


# what a run says only the first time anything on the machine needs it (runtime/notice.py's lines):
# a preset dequantised and cached, exported, the kernels timed once, and a measurement kept per
# machine (runtime/measured.py's one line, "measuring once on this machine: WHAT, for MODEL (...)")
ONE_TIME_PROGRESS = ("first load of ", "exporting ", "timing ")
ONE_TIME_MEASUREMENT = re.compile(
    r"measuring once on this machine: .+, for .+ \(.+; `omnidraft doctor --reset` forgets it\)$"
)


def unasked_output(stderr: str) -> list[str]:
    """What a run wrote to stderr besides the progress of one-time work: a warning, a log line,
    a progress bar shown on every run. A quiet run has none."""
    return [
        piece
        for piece in re.split(r"[\r\n]", stderr)
        if piece.strip() and not piece.startswith(ONE_TIME_PROGRESS) and not ONE_TIME_MEASUREMENT.match(piece)
    ]


def gsm8k_texts(split: str = "train", n: int = 1500) -> list[str]:
    from omnidraft.bench.datasets import gsm8k_rows

    return [f"Question: {d['question']}\nAnswer: {d['answer']}" for d in gsm8k_rows(split)[:n]]


def train_bpe(vocab_size: int, texts: list[str]):
    """A byte-level BPE tokenizer of `vocab_size` tokens, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def tiny_llama(vocab_size: int, seed: int, logit_scale: float = 1.0, *, wide: bool = False):
    """A 2-layer, 32-wide Llama with random weights (seeded); `logit_scale` sharpens its outputs.
    `wide`: 64 wide in two heads of 32 (vLLM's CPU attention needs a head width it has kernels for)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (
        {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
        if wide
        else {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    )
    config = LlamaConfig(
        vocab_size=vocab_size,
        **shape,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval().requires_grad_(False)


def tiny_gemma3(sliding_window: int = 4):
    """A 2-layer Gemma 3 text model (one sliding-window layer, one global) with random weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return gsm8k_texts()


@pytest.fixture(scope="session")
def draft_tokenizer(texts):
    return train_bpe(400, texts)


@pytest.fixture(scope="session")
def target_tokenizer(texts):
    return train_bpe(700, texts)


@pytest.fixture(scope="session")
def tiny_target(target_tokenizer):
    from omnidraft import LocalTarget

    return LocalTarget(
        tiny_llama(len(target_tokenizer), seed=1, logit_scale=30.0), target_tokenizer, "tiny-target"
    )


@pytest.fixture(scope="session")
def tiny_drafter(draft_tokenizer):
    from omnidraft import TorchDrafter as Drafter

    return Drafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny-drafter"
    )


_REAL_TARGETS: dict[str, object] = {}
_GREEDY: dict[tuple[int, str, int], list[int]] = {}


def real_target(name: str):
    """A shipped model as a `LocalTarget`, the small ones loaded once per test process: real-model
    tests share them (none changes a target; a test that patches one undoes it). The 1.5B (6 GB in
    fp32) is loaded for each test that asks: two workers' copies would crowd the memory."""
    from omnidraft import LocalTarget

    if name.endswith("1.5b"):
        return LocalTarget.load(name)
    if name not in _REAL_TARGETS:
        _REAL_TARGETS[name] = LocalTarget.load(name)
    return _REAL_TARGETS[name]


def target_greedy(target, prompt: str, n: int) -> list[int]:
    """The target's own greedy continuation, by HF generate (remembered for the process's shared
    real targets: several tests check pairings against the same reference)."""
    key = (id(target), prompt, n)
    if key in _GREEDY:
        return list(_GREEDY[key])
    out = _generate_greedy(target, prompt, n)
    if any(target is t for t in _REAL_TARGETS.values()):
        _GREEDY[key] = list(out)
    return out


def _generate_greedy(target, prompt: str, n: int) -> list[int]:
    ids = target.tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=sorted(target.eos_ids),
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


def chi_square_p(observed, expected) -> float:
    """scipy's chi-square p-value, the expected counts rescaled (float64) to the observed total:
    scipy refuses totals that differ in the eighth digit, which float32 probabilities do."""
    from scipy.stats import chisquare

    observed = [float(o) for o in observed]
    expected = [float(e) for e in expected]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def assert_first_tokens_follow(target, prompt: str, counts) -> None:
    """First generated tokens (`counts`: token -> times) against the target's softmax after
    `prompt`: chi-square over the tokens with expected count >= 5 plus one pooled bin, alpha =
    0.001 (a correct engine fails by chance once in 1,000 seeds; the seeds are fixed)."""
    n = sum(counts.values())
    ids = target.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        p = torch.softmax(target.model(ids).logits[0, -1].float(), -1)
    big = [t for t in range(len(p)) if p[t] * n >= 5]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [float(p[t]) * n for t in big] + [n - sum(float(p[t]) * n for t in big)]
    assert len(big) >= 5
    assert chi_square_p(observed, expected) > 1e-3
