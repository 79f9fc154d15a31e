"""Incremental detokenization and stop-string matching for streamed output.

`IncrementalDetokenizer` turns tokens into text as they arrive without ever
emitting half a UTF-8 character: it decodes a small window of tokens (prefix
and read offsets, as vLLM and SGLang do) and only releases text once the window
no longer ends in U+FFFD. `StopStringMatcher` holds back the longest tail that
could still grow into a stop string, so a stop split across tokens is caught
and never reaches the client.
"""
from __future__ import annotations

from functools import lru_cache

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6   # prompt tokens decoded along with the output, for tokenizers whose spacing depends on them


class IncrementalDetokenizer:
    """Feed token ids one call at a time; get back only text that is final."""

    def __init__(self, tokenizer, prompt_ids: list[int] = (), skip_special_tokens: bool = True):
        self.decode = direct_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []            # the prompt ends inside a character: its text cannot be a clean prefix
        self.ids: list[int] = context
        self.prefix_offset = 0              # start of the window decoded for comparison
        self.read_offset = len(context)     # tokens before it have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is safe to emit (maybe "")."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""   # nothing new yet, or a multi-byte character is still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """The text of tokens still held back (an unfinished character at the very end decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


def direct_decoder(tokenizer):
    """The tokenizer's decode, or its Rust backend's where that gives the same text (a fast tokenizer
    that cleans up no spaces): twice per streamed token, the Python wrapper around it cost three
    times the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back what could still become one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the stop string matched or None). After a match, stop feeding."""
        if not self.stops:
            return text, None
        self.pending += text
        hit = self._earliest_match()
        if hit is not None:
            index, stop = hit
            emit, self.pending = self.pending[:index], ""
            return emit, stop
        keep = self._longest_partial_suffix()
        cut = len(self.pending) - keep
        emit, self.pending = self.pending[:cut], self.pending[cut:]
        return emit, None

    def flush(self) -> str:
        """Release held-back text at the end of the output."""
        out, self.pending = self.pending, ""
        return out

    def _earliest_match(self) -> tuple[int, str] | None:
        best = None
        for stop in self.stops:
            index = self.pending.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_partial_suffix(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class TokenTexts:
    """The text (and exact bytes) of single tokens, for logprobs; cached per tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            found = (text, self._bytes(token_id, text))
            self._cache[token_id] = found
        return found

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        """Byte-level BPE pieces map back to their exact bytes (a lone byte of an emoji, say)."""
        if REPLACEMENT in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = byte_level_decoder()
            if isinstance(piece, str) and piece and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(text.encode("utf-8"))


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table used by byte-level BPE vocabularies."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in visible:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table
