"""N-gram (prompt lookup) drafting: the request's last n tokens are searched for earlier in its own
tokens, prompt and output; the tokens that followed the first earlier occurrence are the draft. Free
of any model, it pays off when outputs copy their input (summaries, code edits, quoting) or repeat."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed an earlier occurrence of the longest matching suffix
        n-gram (n from prompt_lookup_max down to prompt_lookup_min); [] when none occurs."""
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows starting before num_tokens - n: the suffix itself is no earlier occurrence.
            windows = sliding_window_view(tokens[: num_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
            if hits.size:
                # The first occurrence, as vLLM: the longest continuation to copy from.
                start = int(hits[0]) + n
                return token_ids[start : start + max_drafts]
        return []
