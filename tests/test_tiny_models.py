"""The tiny GGUF models load in the real llama.cpp and behave as the rest of the suite assumes.

`tiny` (tests/conftest.py) is build_all() into a session temporary folder."""

from __future__ import annotations

import jinja2
import numpy as np
import pytest
import tiny_models
from tiny_models import VARIANTS, bpe_vocab, build_all, make_weights, write_model

llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog.\nIt's 42, isn't it?",
    "python": 'def hello():\n    return "こんにちは"\n\n\tx = [1, 2]  # comment\n',
    "japanese": "今日はとても良い天気です。未知の漢字：鬱、薔薇。",
    "emoji": "Hi 🙂👍🏽 — café, naïve, 🇯🇵!",
}


def load(path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), n_threads=2, n_threads_batch=2, n_ctx=256, verbose=False, **kwargs)


@pytest.fixture(scope="session")
def target(tiny):
    return load(tiny["target"], logits_all=True)


def greedy(llm, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens one at a time, and the top-1 minus top-2 logit gap at each step."""
    llm.reset()
    llm.eval(prompt)
    tokens, gaps = [], []
    for _ in range(n):
        row = np.asarray(llm.scores[llm.n_tokens - 1])
        top2 = np.sort(row)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        tokens.append(int(row.argmax()))
        llm.eval([tokens[-1]])
    return tokens, gaps


def batched_argmax(llm, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The argmax after each position of prompt + tokens[:-1], from one batched eval."""
    llm.reset()
    llm.eval(prompt + tokens[:-1])
    rows = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])
    return rows.argmax(axis=1)


def test_build_all_makes_every_variant_small(tiny):
    assert tuple(tiny) == VARIANTS
    for path in tiny.values():
        assert path.stat().st_size < 1_000_000


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_loads(tiny, name):
    llm = load(tiny[name])
    assert llm.n_vocab() == int(llm.metadata["llama.vocab_size"])
    assert llm.metadata["llama.attention.head_count_kv"] == "2"
    assert llm.tokenize(b"hello world", add_bos=False)


@pytest.mark.parametrize("kind", TEXTS)
def test_text_round_trips(target, kind):
    text = TEXTS[kind].encode()
    tokens = target.tokenize(text, add_bos=False, special=False)
    assert target.detokenize(tokens) == text


def test_common_words_are_single_tokens(target):
    for word in (b" the", b" model", b" return", b"\xe3\x81\xa7\xe3\x81\x99"):  # " ... です"
        assert len(target.tokenize(word, add_bos=False)) == 1, word


def test_split_char_spans_two_tokens(target):
    tokens = target.tokenize(tiny_models.SPLIT_CHAR.encode(), add_bos=False)
    assert len(tokens) == 2
    pieces = [target.detokenize([t]) for t in tokens]
    assert b"".join(pieces) == tiny_models.SPLIT_CHAR.encode()
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")


def test_control_tokens(target):
    vocab = bpe_vocab()
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert target.tokenize(text.encode(), add_bos=False, special=True) == [vocab.id_of(text)]
    assert target.token_eos() == vocab.id_of("<|im_end|>")
    assert target.token_bos() == vocab.id_of("<|endoftext|>")
    assert min(vocab.id_of(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")) > 5
    assert target.metadata["tokenizer.ggml.add_bos_token"] == "false"


def test_chat_template_is_chatml(target):
    template = target.metadata["tokenizer.chat_template"]
    messages = [{"role": "user", "content": "Hi"}]
    text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_writer_is_deterministic(tmp_path, tiny):
    vocab = bpe_vocab()
    a = write_model(tmp_path / "a.gguf", vocab=vocab, weights=make_weights(1, len(vocab)), name="tiny-target")
    b = write_model(tmp_path / "b.gguf", vocab=vocab, weights=make_weights(1, len(vocab)), name="tiny-target")
    assert a.read_bytes() == b.read_bytes() == tiny["target"].read_bytes()
    assert build_all(tmp_path / "again")["draft-perturbed"].read_bytes() == (tiny["draft-perturbed"].read_bytes())


def test_vocabulary_variants(tiny):
    vocab = bpe_vocab()
    target = load(tiny["target"])
    plus = load(tiny["vocab-plus100"])
    assert plus.n_vocab() == target.n_vocab() + 100
    changed = load(tiny["vocab-changed"])
    changed_id = tiny_models.with_changed_token(vocab)[1]
    assert changed_id > 5
    assert changed.detokenize([changed_id]) != target.detokenize([changed_id])
    assert load(tiny["eos-changed"]).token_eos() != target.token_eos()
    other = load(tiny["other-family"])
    assert other.metadata["tokenizer.ggml.model"] == "llama"
    assert other.tokenize(b"hello world") != target.tokenize(b"hello world")


def test_greedy_margins_are_wide(target):
    prompt = target.tokenize(b"The quick brown fox", add_bos=False)
    tokens, gaps = greedy(target, prompt, 100)
    assert min(gaps) > 1e-3  # measured: 6.5e-3; batched and one-token logits differ by ~1e-5
    assert len(set(tokens)) > 10  # the text varies, not one token forever


def test_batched_logits_pick_the_same_greedy_tokens(target):
    prompt = target.tokenize("def hello(): return 'こんにちは'".encode(), add_bos=False)
    tokens, _ = greedy(target, prompt, 100)
    assert batched_argmax(target, prompt, tokens).tolist() == tokens


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("draft-copy", 1.0, 1.0),
        ("draft-perturbed", 0.5, 0.95),
        ("draft-small", 0.3, 1.0),
        ("draft-unrelated", 0.0, 0.3),
    ],
)
def test_draft_agreement_with_target(tiny, target, name, low, high):
    prompt = target.tokenize(b"A language model reads", add_bos=False)
    tokens, _ = greedy(target, prompt, 100)
    draft = load(tiny[name], logits_all=True)
    agreement = float(np.mean(batched_argmax(draft, prompt, tokens) == tokens))
    assert low <= agreement <= high
