"""Incremental detokenization and stop strings (server/detokenizer.py)."""
from __future__ import annotations

import pytest

from server.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopStringMatcher, TokenTexts, direct_decoder
from tests.fake_engine import build_test_tokenizer, byte_token_ids

MULTIBYTE = "héllo 😀 世界 — ok 👍🏽"


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


def plain_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.add([tok]) for tok in ids]
    return pieces + [detok.flush()]


def test_multibyte_split_across_byte_tokens_never_yields_replacement(tokenizer):
    ids = byte_token_ids(tokenizer, MULTIBYTE)
    assert len(ids) == len(MULTIBYTE.encode("utf-8"))      # one token per byte: characters really are split
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE


def test_multibyte_with_regular_tokens_and_prompt_context(tokenizer):
    prompt = tokenizer.encode("Hello world")
    ids = plain_ids(tokenizer, "The fox ") + byte_token_ids(tokenizer, "世界😀") \
        + plain_ids(tokenizer, " jumps over")
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) == "The fox 世界😀 jumps over"


def test_several_tokens_per_call(tokenizer):
    ids = byte_token_ids(tokenizer, MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE


def test_special_tokens_skipped_by_default(tokenizer):
    ids = plain_ids(tokenizer, "Hello") + [tokenizer.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "Hello"
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == "Hello" + tokenizer.eos_token


@pytest.mark.parametrize("skip", [True, False])
def test_the_direct_decoder_gives_the_tokenizers_text(skip):
    from transformers import AutoTokenizer

    from tests.server_harness import DENSE

    tok = AutoTokenizer.from_pretrained(DENSE)
    decode = direct_decoder(tok)
    assert decode == tok.backend_tokenizer.decode           # the embedded tokenizer takes the fast path
    ids = tok.encode("def f(x):\n    return x  # héllo 😀 <|im_end|>") + [tok.eos_token_id, 5, 4095]
    windows = [ids[i:j] for i in range(len(ids)) for j in range(i + 1, min(len(ids), i + 7) + 1)]
    assert all(decode(w, skip_special_tokens=skip) == tok.decode(w, skip_special_tokens=skip) for w in windows)
    tok.clean_up_tokenization_spaces = True                 # the wrapper's clean-up: its own decode
    assert direct_decoder(tok) == tok.decode


def test_unfinished_character_at_the_end_is_released_on_flush(tokenizer):
    ids = byte_token_ids(tokenizer, "ok😀")[:-1]       # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in ids) == "ok"
    assert detok.flush() == REPLACEMENT


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for chunk in chunks:
        emit, hit = matcher.feed(chunk)
        out.append(emit)
        if hit:
            return "".join(out), hit
    return "".join(out) + matcher.flush(), None


def test_stop_string_split_across_chunks():
    assert feed_all(StopStringMatcher(["STOP"]), ["abc S", "T", "OP tail"]) == ("abc ", "STOP")


def test_held_back_text_released_when_it_cannot_become_a_stop():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("x") == ("STx", None)


def test_held_back_text_released_at_the_end():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("value </en") == ("value ", None)
    assert matcher.flush() == "</en"


def test_earliest_of_several_stops_wins():
    assert feed_all(StopStringMatcher(["world", "lo w"]), ["hel", "lo world"]) == ("hel", "lo w")


def test_overlapping_prefix_is_found():
    assert feed_all(StopStringMatcher(["abac"]), ["aba", "bac!"]) == ("ab", "abac")


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_stop_string_over_byte_split_characters(tokenizer):
    ids = byte_token_ids(tokenizer, "ab世界cd")
    detok, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher(["界c"])
    out, hit = [], None
    for tok in ids:
        emit, hit = matcher.feed(detok.add([tok]))
        out.append(emit)
        if hit:
            break
    assert ("".join(out), hit) == ("ab世", "界c")


def test_token_texts_give_exact_bytes_of_partial_characters(tokenizer):
    ids = byte_token_ids(tokenizer, "😀")
    texts = TokenTexts(tokenizer)
    assert sum((texts.get(t)[1] for t in ids), []) == list("😀".encode("utf-8"))
