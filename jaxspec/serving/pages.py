"""The host-side allocator of the paged KV pool (`pallas_kernels.paging`): which pages each row owns,
and which full prompt pages stay cached for later requests that share the prefix.

The scheduler asks `allocate` for a row's pages and hands them back with `release`; rows
that no longer fit are preempted by releasing their pages. Prefix caching keys each full page by a
hash chained from the start of the sequence, so a page is found only when every token before it
matches too: `match` hands a new row the cached pages of its prompt's longest cached prefix, and
`register` keys the full pages a row has just written. A page no row references stays cached (and
findable) until `allocate` needs it, least recently released first, so spare pages hold as many
prefixes as fit without ever keeping a row from the pages it needs. The pool is not locked: the
scheduler's thread owns it and reports its figures (`in_use`, `cached`, `free`, `hit_rate`).

A cached page is shared read-only: a row never writes a page it did not allocate itself. The scheduler
hands matched pages only for positions below the row's prompt length - 1 (`match` never covers the
last prompt token, whose logits the prefill must compute), and a row writes only at positions at or
past its cached prefix, i.e. into its own pages.

Page 0 is the null page (`paging.NULL_PAGE`): never handed out, so unused table entries can point at it.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterator, Sequence

import numpy as np

from pallas_kernels.paging import NULL_PAGE


class PagePool:
    """Pages 1..num_pages-1 of a pool of `page_size`-slot pages, each in exactly one state: in use
    (referenced by rows, `refcount` > 0), cached (keyed by a prefix hash, unreferenced, evictable) or
    free."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"a page pool needs an allocatable page besides the null page and a positive page size, "
                             f"got {num_pages} pages of {page_size} slots")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # popped from the end: lowest page first
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recent first
        self._key_of: dict[int, bytes] = {}  # cached page -> its chained key
        self._page_of: dict[bytes, int] = {}  # chained key -> its one cached page
        self.hit_tokens = 0  # prompt tokens served from cache (`match`)
        self.lookup_tokens = 0  # prompt tokens looked up (`match`)

    # --- accounting (/metrics) -----------------------------------------------------------------------

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        """Cached pages no row references (evictable)."""
        return len(self._evictable)

    @property
    def in_use(self) -> int:
        """Pages some row references."""
        return self.num_pages - 1 - self.free - self.cached

    @property
    def available(self) -> int:
        """What `allocate` can hand out now: free and evictable pages."""
        return self.free + self.cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, tokens: int) -> int:
        """Pages needed for `tokens` slots."""
        return -(-tokens // self.page_size)

    # --- rows' pages --------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages for one row's exclusive use, free ones first, then the least recently released
        cached ones (their keys are dropped); None, with nothing taken, if fewer than `n` are available."""
        if n > self.available:
            return None
        taken = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            taken.append(page)
        return taken

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference from each page. An unreferenced cached page stays cached as the most
        recently released; the list is walked from its end, so a prefix's later pages are evicted before
        its earlier ones (evicting an early page first would leave the later ones unreachable)."""
        for page, n in collections.Counter(pages).items():
            if not NULL_PAGE < page < self.num_pages or self._refs[page] < n:
                raise ValueError(f"page {page} is released more often than it is held")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # --- prefix caching -----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached pages of the longest cached prefix of a prompt `tokens`, whole pages only and
        never its last token (at most (len(tokens) - 1) // page_size pages), each with a reference taken
        for the row. Counts len(tokens) looked-up tokens and the matched pages' tokens as hits."""
        self.lookup_tokens += len(tokens)
        if not self.prefix_cache:
            return []
        pages = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.page_size):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def unmatch(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Gives back `match(tokens)`'s pages and counts when the row could not be admitted after all."""
        self.release(pages)
        self.lookup_tokens -= len(tokens)
        self.hit_tokens -= len(pages) * self.page_size

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Keys the full pages of `tokens` (the first len(tokens) // page_size of the row's `pages`,
        whose KV the row has written) that are not keyed yet. A key another page already holds stays
        with that page (no duplicates); the row's page then stays unkeyed and is freed on release."""
        if not self.prefix_cache:
            return
        full = len(tokens) // self.page_size
        if len(pages) < full:
            raise ValueError(f"{len(tokens)} tokens fill {full} pages, but the row has {len(pages)}")
        for page, key in zip(pages, self._keys(tokens, full)):
            if self._refs[page] == 0:
                raise ValueError(f"page {page} is not held by the row registering it")
            if page in self._key_of:
                if self._key_of[page] != key:
                    raise ValueError(f"page {page} is cached for other tokens")
            elif key not in self._page_of:
                self._key_of[page] = key
                self._page_of[key] = page

    def _keys(self, tokens: Sequence[int], n: int) -> Iterator[bytes]:
        """The chained keys of the first `n` pages of `tokens`: page i's hashes page i-1's key and its
        own token ids (blake2b: the same across runs and processes, unlike `hash`)."""
        key = b""
        P = self.page_size
        for i in range(n):
            ids = np.asarray(tokens[i * P:(i + 1) * P], dtype="<i8").tobytes()
            key = hashlib.blake2b(key + ids, digest_size=16).digest()
            yield key
