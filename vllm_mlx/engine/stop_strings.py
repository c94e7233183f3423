"""Stop strings over streamed text: one Aho–Corasick automaton per stop list, one scanner per stream.

``StopScanner(stops)`` is fed text as it arrives; ``feed(text)`` returns the part that can be shown
and sets ``stop_string`` when one completes; ``flush()`` returns what was held back when the stream
ends without a match. ``IncrementalDetokenizer`` uses it; its module docstring states the contract.

Invariants:

* A state of the automaton is a prefix of some stop string (its ``depth`` is the prefix length).
  After each character the current state is the *longest* suffix of all text fed so far that is
  such a prefix, so it is exactly the text to hold back: it may still grow into a stop string, and
  no longer suffix can. The held text is those ``depth[state]`` characters, never more.
* Characters are fed one at a time, so the first position at which some stop string ends is found
  first, however the text was chunked; ``longest[state]`` is the longest stop string ending there
  (the longest one on the state's failure chain), so of two ending together the longer wins.
* Memory is linear in the total stop length: one state per distinct prefix, a few machine ints
  each (see ``StopAutomaton``). No prefix is ever materialised as a string.
* Work is amortized O(1) per character: the depth grows by at most one per character and every
  failure step lowers it (the classic Aho–Corasick argument), and the held text is kept as the
  chunks it was fed in, so a long held prefix is shifted, never copied, as text streams through it.
* ``automaton(stops)`` is built once per distinct stop tuple and cached (bounded LRU): the ``n``
  completions of a request and requests repeating the same stop list share one automaton.
"""

from __future__ import annotations

from array import array
from collections import deque
from functools import lru_cache

__all__ = ["StopAutomaton", "StopScanner", "automaton"]

_SHIFT = 21  # every code point is below 2**21: an edge's key is ``state << _SHIFT | ord(char)``


class StopAutomaton:
    """An Aho–Corasick automaton over stop strings (immutable once built; shared across threads).

    States are numbered breadth-first (by depth), so a failure link always points to a lower number.
    Each state's first child is stored in two arrays (``child_code``/``child``); only further
    children, at most one per stop string, take a ``goto`` dict entry. A long stop string thus costs
    five machine ints per character and no Python object.
    """

    __slots__ = ("child_code", "child", "goto", "fail", "depth", "longest")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.child_code = array("i", [-1])  # code point of the state's first child; -1: none
        self.child = array("i", [0])
        self.goto: dict[int, int] = {}  # the other children
        self.fail = array("i", [0])  # the longest proper suffix of the state that is a state
        self.depth = array("i", [0])  # length of the prefix a state stands for
        self.longest = array("i", [0])  # the longest stop string ending at the state; 0: none
        active = sorted(stops, key=len, reverse=True)
        at = [0] * len(active)  # the state each stop string has reached
        for level in range(len(active[0]) if active else 0):  # breadth-first: one depth at a time
            while len(active[-1]) <= level:  # the shortest are done
                active.pop()
            for k, stop in enumerate(active):
                at[k] = self._extend(at[k], ord(stop[level]))
                if len(stop) == level + 1:
                    self.longest[at[k]] = level + 1
        for state in range(1, len(self.depth)):  # a failure link points to a lower state
            if not self.longest[state]:
                self.longest[state] = self.longest[self.fail[state]]

    def _extend(self, state: int, code: int) -> int:
        """The child of ``state`` by ``code``, created (with its failure link) if new."""
        first = self.child_code[state]
        if first == code:
            return self.child[state]
        new = len(self.depth)
        if first < 0:  # a leaf so far
            self.child_code[state], self.child[state] = code, new
        elif (nxt := self.goto.setdefault(state << _SHIFT | code, new)) != new:
            return nxt
        # Every state of lower depth exists already, so the link can be followed now.
        self.fail.append(self.step(self.fail[state], code) if state else 0)
        self.depth.append(self.depth[state] + 1)
        self.longest.append(0)
        self.child_code.append(-1)
        self.child.append(0)
        return new

    def step(self, state: int, code: int) -> int:
        """The state after character ``chr(code)``: the longest prefix that is still a suffix."""
        while True:
            first = self.child_code[state]
            if first == code:
                return self.child[state]
            if first >= 0 and (nxt := self.goto.get(state << _SHIFT | code)) is not None:
                return nxt
            if not state:
                return 0
            state = self.fail[state]


@lru_cache(maxsize=16)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of a stop tuple, cached: built once for all completions using that tuple."""
    return StopAutomaton(stops)


class StopScanner:
    """Streams text through a stop list; see the module docstring for the invariants."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._automaton = automaton(stops)
        self._state = 0
        self._held: deque[str] = deque()  # the fed chunks not yet shown (all of them held text) ...
        self._shown = 0  # ... but for this many characters of the first one
        self._held_len = 0  # characters held: always ``depth[state]`` between calls
        self.stop_string: str | None = None

    def feed(self, text: str) -> str:
        """Feed ``text``; return what became visible (text before a match is shown, the rest dropped)."""
        if self.stop_string is not None:
            return ""
        auto, state = self._automaton, self._state
        for i, char in enumerate(text):
            state = auto.step(state, ord(char))
            if auto.longest[state]:
                return self._matched(text[: i + 1], auto.longest[state])
        self._state = state
        if not self._held and not auto.depth[state]:  # the common case: nothing held, nothing to hold
            return text
        self._held.append(text)
        self._held_len += len(text)
        return self._release(self._held_len - auto.depth[state])

    def flush(self) -> str:
        """The held text, when the stream ended without a match."""
        out = "".join(self._held)[self._shown :]
        self._held.clear()
        self._shown = self._held_len = 0
        return out

    def _release(self, count: int) -> str:
        """Show the first ``count`` held characters: whole chunks are popped, none is copied twice."""
        out = []
        self._held_len -= count
        while count:
            chunk, shown = self._held[0], self._shown
            if len(chunk) - shown > count:
                out.append(chunk[shown : shown + count])
                self._shown += count
                break
            out.append(chunk[shown:])
            count -= len(chunk) - shown
            self._held.popleft()
            self._shown = 0
        return "".join(out)

    def _matched(self, text: str, length: int) -> str:
        region = self.flush() + text  # once per stream: the stop string ends here
        cut = len(region) - length
        self.stop_string = region[cut:]
        return region[:cut]
