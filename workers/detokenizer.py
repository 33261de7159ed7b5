"""Token ids to text, one step at a time: UTF-8 safe deltas, stop strings, streaming holdback.

Three layers, use whichever fits the caller:

- `IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)`, one per
  sequence. `det.step(new_ids) -> delta` returns only text that can no longer change: a byte-level
  BPE token may end halfway through a multi-byte character, and that character is held back
  until the tokens that complete it arrive. `det.flush()` releases what is still held when the
  sequence ends (as U+FFFD if it never completed). For byte-level tokenizers the deltas add up
  to exactly `tokenizer.decode(output_ids, skip_special_tokens=...)`. Cost per step: one or two
  decodes of a window of a few tokens, independent of the output length.
- `find_stop(text, stops, start, include_stop_str_in_output)` looks for a stop string among
  the occurrences that end after `start` (the length before the last delta), so each check
  costs only the new tail, and a stop string split across tokens is still found.
  `stop_holdback(text, stops)` says how many trailing characters could still be the start of a
  stop string; a stream must not show them yet, or it could show part of a stop string that
  later matches and is cut away.
- `OutputText` puts the three together the way the engine uses them per sequence:

      out = OutputText(tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                       params.include_stop_str_in_output)
      stop = out.step([token], check_stop=num_output_tokens >= params.min_tokens)
      if stop is not None: finish "stop" with stop_reason=stop (out.text is already cut)
      elif finishing for another reason (eos, length, abort): out.flush()
      delta = out.pop_delta(finished)    # what to stream now; everything once finished

  A stop *token* (EOS, stop_token_ids) should not be fed to `step` unless its text is wanted.

Which stop string wins: the one whose occurrence ends first; on a tie the one that starts first
(the longer). That answer does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

# Prompt tokens decoded as context for the first output tokens: enough for decoders whose
# output depends on the previous token (SentencePiece's leading space), small enough to be cheap.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-sequence incremental decoding that never emits a partial UTF-8 character."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only a window of ids is kept: [prefix, read) was decoded and emitted already and
        # serves as context; [read, end) is not emitted yet.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (ids given directly); as context it would
            # swallow the first output bytes, so decode the output on its own instead.
            self._ids, self._prefix_text = [], ""
        self._read = len(self._ids)
        # Deltas are collected and joined only when `text` is read: `str +=` on an attribute
        # copies the whole text every step, which adds up over long outputs.
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        full = self._decode(self._ids)
        if len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (a skipped special token) or a character still open
        return self._emit(full)

    def flush(self) -> str:
        """Release whatever is held back; call once the sequence has ended."""
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids)
        return self._emit(full) if len(full) > len(self._prefix_text) else ""

    def _emit(self, full: str) -> str:
        delta = full[len(self._prefix_text) :]
        # What was just emitted becomes the context for the next step.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._parts.append(delta)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""


class StopMatch(NamedTuple):
    stop: str  # the stop string that matched
    cut: int  # the text's new length: before the stop string, or after it when it is kept


def find_stop(
    text: str, stops: Sequence[str], start: int, include_stop_str_in_output: bool = False
) -> StopMatch | None:
    """The stop string occurrence that completes first among those ending after `start`.

    `start` is how long the text was when it was last checked; earlier occurrences were
    already ruled out, so only the tail (and the len(stop) - 1 characters before it) is read.
    """
    best: tuple[int, int, str] | None = None  # (end, begin, stop)
    for stop in stops:
        if not stop:
            continue
        begin = text.find(stop, max(0, start - len(stop) + 1))
        if begin != -1 and (best is None or (begin + len(stop), begin) < best[:2]):
            best = (begin + len(stop), begin, stop)
    if best is None:
        return None
    end, begin, stop = best
    return StopMatch(stop, end if include_stop_str_in_output else begin)


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` are a proper prefix of some stop string."""
    held = 0
    for stop in stops:
        # Only the last len(stop) - 1 characters can begin this stop without completing it;
        # the leftmost place where one does gives the longest held tail for this stop.
        tail = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
        i = tail.find(stop[0]) if tail else -1
        while i != -1:
            if stop.startswith(tail[i:]):
                held = max(held, len(tail) - i)
                break
            i = tail.find(stop[0], i + 1)
    return held


class OutputText:
    """One sequence's output text: detokenized, cut at stop strings, streamed safely."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stops = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.stop: str | None = None  # set once a stop string matched; text is final then
        self._sent = 0

    def step(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append the tokens' text; return the stop string if one now matches."""
        if self.stop is not None:
            raise RuntimeError("the sequence already stopped at a stop string")
        before = len(self.text)
        self.text += self.detokenizer.step(token_ids)
        if not (check_stop and self.stops) or len(self.text) == before:
            return None
        match = find_stop(self.text, self.stops, before, self.include_stop_str_in_output)
        if match is None:
            return None
        self.stop, self.text = match.stop, self.text[: match.cut]
        return match.stop

    def flush(self) -> None:
        """The sequence ended for a reason other than a stop string: release held bytes."""
        if self.stop is None:
            self.text += self.detokenizer.flush()

    def mark_sent(self, num_chars: int) -> None:
        """The first `num_chars` characters were streamed already (a resumed sequence)."""
        self._sent = num_chars

    def pop_delta(self, finished: bool) -> str:
        """Text not streamed yet; while running, minus what may still begin a stop string."""
        end = len(self.text)
        if not finished and self.stop is None:
            end -= stop_holdback(self.text, self.stops)
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : end], end
        return delta
