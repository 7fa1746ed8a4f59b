"""An incremental suffix automaton over token ids, and a matcher that follows a token stream on it.

The automaton (Blumer et al.; the index SAM-Decoding uses) of a text T of n tokens has at most
2n - 1 states and 3n - 4 transitions, and `extend` adds one token in O(1) amortised time. Each
state keeps `first`: the end (exclusive) of the first occurrence of its strings in T, so a match
found in the automaton points straight at the tokens that followed it.

A `Matcher` holds the longest suffix of a stream (the committed context) that occurs in T, as a
(state, length) pair; `advance` moves it by one token in O(1) amortised time. Its continuation is
what followed the first occurrence of that suffix in T: a retrieval draft. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Matcher", "SuffixAutomaton"]


class SuffixAutomaton:
    """The suffix automaton of `tokens`, built one token at a time."""

    __slots__ = ("tokens", "next", "link", "length", "first", "last")

    def __init__(self, tokens: list[int] | tuple[int, ...] = ()) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first: list[int] = [0]
        self.last = 0  # the state of the whole text
        for token in tokens:
            self.extend(token)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def states(self) -> int:
        return len(self.next)

    @property
    def transitions(self) -> int:
        return sum(map(len, self.next))

    def _state(self, length: int, first: int, link: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        return len(self.next) - 1

    def extend(self, token: int) -> None:
        """Append one token to the text."""
        self.tokens.append(token)
        nxt, link, length = self.next, self.link, self.length
        cur = self._state(length[self.last] + 1, len(self.tokens), 0, {})
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone takes the shorter strings, with q's transitions and first end
                clone = self._state(length[p] + 1, self.first[q], link[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def occurs(self, pattern: list[int]) -> bool:
        """Whether `pattern` occurs in the text (O(len(pattern)))."""
        s = 0
        for token in pattern:
            s = self.next[s].get(token, -1)
            if s < 0:
                return False
        return True


@dataclass(frozen=True)
class Matcher:
    """The longest suffix of a stream that occurs in an automaton's text: `length` tokens, in
    `state`. Immutable: `advance` returns the next matcher, so a draft can be matched ahead
    without touching the committed one."""

    state: int = 0
    length: int = 0

    def advance(self, sam: SuffixAutomaton, token: int) -> Matcher:
        """The matcher after the stream gains `token`."""
        s, n = self.state, self.length
        nxt, link, length = sam.next, sam.link, sam.length
        # the automaton may have split states since this matcher was made: the match belongs to the
        # shortest state on the suffix-link path whose strings are still at least n long
        while s and length[link[s]] >= n:
            s = link[s]
        while s and token not in nxt[s]:
            s = link[s]
            n = length[s]
        t = nxt[s].get(token)
        if t is None:
            return Matcher(0, 0)
        return Matcher(t, n + 1)

    def end(self, sam: SuffixAutomaton) -> int:
        """Where the matched suffix's first occurrence ends in the text (exclusive); 0 for none."""
        return sam.first[self.state] if self.length else 0

    def continuation(self, sam: SuffixAutomaton, n: int, *, stop: int | None = None) -> list[int]:
        """Up to `n` tokens that followed the match's first occurrence, cut before `stop`."""
        if not self.length or n < 1:
            return []
        start = sam.first[self.state]
        out = sam.tokens[start : start + n]
        if stop is not None and stop in out:
            out = out[: out.index(stop)]
        return out
