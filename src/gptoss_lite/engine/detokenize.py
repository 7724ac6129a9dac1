"""A request's output text, built one token at a time, with its stop strings checked as it grows.

`TextStream.push(token)` costs what the new token adds, not what the output already holds: the
tokenizer's decoder sees only the new token (a byte tokenizer: UTF-8 bytes into an incremental
decoder; a `tokenizer.json`: the last few tokens, the way vLLM detokenises), and each stop string is
a Knuth-Morris-Pratt matcher fed only the new characters. So neither a 65K-token output nor four
long stop strings make a token slower than the first.

The text stays exact: a multi-byte character cut between tokens appears once it is whole, a stop
string that spans tokens is found, and the text is cut before it (the earliest stop to start, when
several end in the same step). `take()` hands out the text that can no longer change: everything
but a tail that could still be the start of a stop string. The pieces `take()` returns concatenate
to `text` once the stream is finished.
"""

from __future__ import annotations

import codecs

HF_PENDING_LIMIT = 16  # tokens a tokenizer.json stream holds while they decode to an incomplete character


class TextStream:
    """See the module docstring. `tokenizer` needs `decode(ids)`; a `token_bytes(id)` method (the byte
    tokenizer has one) makes decoding exact byte by byte."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._bytes = getattr(tokenizer, "token_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # tokenizer.json path: ids since `_prefix`
        self._prefix = self._read = 0  # tokenizer.json path: context start and end of the text committed
        self._matchers = [_StopMatcher(s) for s in stops]
        self._taken: list[str] = []  # text handed out by take()
        self._pending = ""  # text committed but not yet handed out
        self._length = 0  # characters committed (taken + pending)
        self.stopped = False  # a stop string was found; the text ends before it
        self.finished = False

    def push(self, token: int) -> bool:
        """Add one generated token; True if this completed a stop string (the text is then cut)."""
        if self.finished:
            raise RuntimeError("push() after finish()")
        return self._commit(self._decode(token))

    def finish(self) -> bool:
        """No more tokens: flush what the decoder still holds. True if that completed a stop string."""
        if self.finished:
            return False
        tail = self._flush() if not self.stopped else ""
        stopped = self._commit(tail)
        self.finished = True
        return stopped

    def take(self) -> str:
        """The text committed since the last take that no later token can change (all of it once finished)."""
        hold = 0 if self.finished or self.stopped else max((m.state for m in self._matchers), default=0)
        ready = self._pending[: len(self._pending) - hold]
        if ready:
            self._taken.append(ready)
            self._pending = self._pending[len(ready) :]
        return ready

    @property
    def text(self) -> str:
        """The whole text so far (what take() gave plus what it still holds)."""
        return "".join(self._taken) + self._pending

    # ---- internals -------------------------------------------------------------------------------------

    def _commit(self, new: str) -> bool:
        if self.stopped or not new:
            return False
        cut = None
        for matcher in self._matchers:
            start = matcher.feed(new, self._length)
            if start is not None and (cut is None or start < cut):
                cut = start
        if cut is None:
            self._pending += new
            self._length += len(new)
            return False
        # A match starts after everything handed out (take() holds back every stop's partial match).
        kept = cut - (self._length - len(self._pending))
        self._pending = (self._pending + new)[:kept]
        self._length = cut
        self.stopped = True
        return True

    def _decode(self, token: int) -> str:
        if self._bytes is not None:
            return self._utf8.decode(self._bytes(token))
        self._ids.append(token)
        decode = self._tokenizer.decode
        known = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        if len(text) > len(known) and (not text.endswith("\ufffd") or len(self._ids) - self._read > HF_PENDING_LIMIT):
            delta = text[len(known) :]
            # Keep a few tokens of context: a tokenizer may decode a token differently at the start.
            self._prefix, self._read = max(self._read - 4, 0), len(self._ids)
            if self._prefix > 64:  # drop ids no later decode looks at
                del self._ids[: self._prefix]
                self._read -= self._prefix
                self._prefix = 0
            return delta
        return ""

    def _flush(self) -> str:
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        decode = self._tokenizer.decode
        return decode(self._ids[self._prefix :])[len(decode(self._ids[self._prefix : self._read])) :]


class _StopMatcher:
    """Knuth-Morris-Pratt over a stream: `state` is the length of the longest suffix of the text fed
    so far that is a prefix of `stop` (so the text a stream must hold back for it)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = [0] * len(stop)  # fail[i]: longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, text: str, offset: int) -> int | None:
        """Feed `text`, which starts at position `offset` of the stream; the start position of the first
        complete match it ends, or None."""
        stop, fail, k = self.stop, self.fail, self.state
        for i, c in enumerate(text):
            while k and c != stop[k]:
                k = fail[k - 1]
            if c == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = k
                    return offset + i + 1 - len(stop)
        self.state = k
        return None
