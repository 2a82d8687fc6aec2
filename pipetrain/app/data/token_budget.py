"""A step as a token budget (``--global-batch-tokens``): how many micro-batches each step holds.

With packed documents of varying length, a fixed count of micro-batches per step holds a varying
number of real tokens, so the optimizer's step weighs batches of different sizes alike. A budget
fixes the tokens instead, as Megatron-LM's and torchtitan's global batch sizes in tokens do: a
step takes the documents left over from the previous one, then the stream's next ones until they
hold ``tokens``; it runs as many micro-batches as those documents fill (best-fit decreasing
rows), rounded to the nearest count the schedule accepts. The step packer fills that count's rows
from those documents and, where they leave gaps, the stream's next ones; what does not fit is
carried to the next step. A step therefore holds about ``tokens`` real tokens, and little padding. Every rank derives the count from (seed, step) alike: the pipeline never has to
negotiate it (``runtime.microbatch_counts``).

The counts a schedule accepts are the ones its builder builds (``schedule.registry``: DualPipeV
needs at least twice the ranks), and at least the pipeline's ranks: with fewer micro-batches than
stages, no rank ever reaches a steady state (every pipeline schedule's bubble is then over half
the step).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

#: how far past a target a legal count is looked for before the schedule is judged to take none
_SEARCH = 64


class StepCounts:
    """The micro-batch counts ``schedule`` runs on ``ranks`` (``stages_per_rank`` each), asked of
    the registry once per count and remembered here."""

    def __init__(self, schedule: str, ranks: int, stages_per_rank: int | None = None) -> None:
        from pipetrain.schedule.registry import family

        family(schedule)  # an unknown name is refused naming the legal ones
        self.schedule, self.ranks, self.stages_per_rank = schedule, ranks, stages_per_rank
        self._known: dict[int, bool] = {}
        self._refusal = ""  # the registry's last refusal, to name when it accepts nothing
        self.fewest = self._up_from(ranks)

    def accepts(self, count: int) -> bool:
        """Whether a step of ``count`` micro-batches per replica may run."""
        if count < self.ranks:
            return False
        if count not in self._known:
            from pipetrain.schedule.registry import build_schedule

            try:
                build_schedule(self.schedule, self.ranks, count, self.stages_per_rank)
                self._known[count] = True
            except ValueError as e:
                self._known[count], self._refusal = False, str(e)
        return self._known[count]

    def nearest(self, wanted: float) -> int:
        """The accepted count nearest ``wanted`` (a tie: the larger, which carries nothing
        over); the fewest when ``wanted`` is below it."""
        above = self._up_from(max(self.fewest, math.ceil(wanted)))
        below = next(
            (n for n in range(math.floor(wanted), self.fewest - 1, -1) if self.accepts(n)), None
        )
        if below is None or above - wanted <= wanted - below:
            return above
        return below

    def _up_from(self, start: int) -> int:
        for n in range(start, start + _SEARCH):
            if self.accepts(n):
                return n
        raise ValueError(
            f"{self.schedule} on {self.ranks} ranks accepts no micro-batch count in "
            f"{start}..{start + _SEARCH - 1} ({self._refusal})"
        )


class TokenBudget:
    """``tokens`` real tokens a step over ``dp`` replicas of micro-batches of ``microbatch_size``
    rows of ``seq_len`` tokens, each replica running a count ``counts`` accepts."""

    def __init__(
        self, tokens: int, counts: StepCounts, *, dp: int, microbatch_size: int, seq_len: int
    ) -> None:
        for name, value in (
            ("tokens", tokens),
            ("dp", dp),
            ("microbatch_size", microbatch_size),
            ("seq_len", seq_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.tokens, self.counts, self.dp = tokens, counts, dp
        self.microbatch_size, self.seq_len = microbatch_size, seq_len
        least = counts.fewest * self.tokens_per_count
        if tokens < least:
            raise ValueError(
                f"a step of {tokens} tokens is less than the fewest micro-batches "
                f"{counts.schedule} runs on {counts.ranks} ranks hold ({counts.fewest} x "
                f"microbatch size {microbatch_size} x dp {dp} x seq_len {seq_len} = {least} "
                f"tokens): give at least {least}"
            )

    @property
    def tokens_per_count(self) -> int:
        """The token slots one more micro-batch per replica adds to a step."""
        return self.dp * self.microbatch_size * self.seq_len

    @property
    def nominal(self) -> int:
        """The count of a step whose documents fill their rows: what the pipeline is built
        with, and the shape of the eval batches."""
        return self.counts.nearest(self.tokens / self.tokens_per_count)

    def count_for(self, lengths: Sequence[int]) -> int:
        """The micro-batches per replica of a step offered documents of ``lengths`` tokens: the
        rows best-fit decreasing packs them into (within 11/9 of the fewest rows, Johnson 1974;
        about the rows the step packer fills, which then tops them up from the stream), over the
        rows of one count, rounded to the nearest accepted count."""
        rooms: list[int] = []  # the open rows' free tokens, ascending
        for n in sorted(lengths, reverse=True):
            at = bisect.bisect_left(rooms, n)
            if at < len(rooms):
                room = rooms.pop(at) - n
            else:
                room = self.seq_len - n
            bisect.insort(rooms, room)
        return self.counts.nearest(len(rooms) / (self.dp * self.microbatch_size))


__all__ = ["StepCounts", "TokenBudget"]
