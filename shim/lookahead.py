"""The next GRPO generation's dataset rows, read from the training sampler before the dataloader yields them.

GRPOTrainer draws its rows through TRL's ``RepeatSampler``: each generation's
global batch of ``G`` indices (``generation_batch_size``) is repeated ``R``
times (``num_iterations × steps_per_generation``) for the training steps that
reuse it, and process ``p`` of ``n`` reads the ``p``-th ``G / n`` slice of
each batch. An epoch's order is drawn all at once, so wrapping the sampler in
a :class:`LookaheadSampler` that keeps the drawn list shows what comes next;
:class:`GenerationLookahead` finds where the current generation sits in that
list (by its rows' keys, so a resumed run or an unexpected order is found
again, not assumed) and reads the keys one generation further on.

A wrong answer costs only sandboxes started for nothing (the prefetch stops
what no reset claims), never a wrong rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

#: The dataset column naming each row's task (the shim's datasets, TRL's ``HarborSpec``).
TASK_COLUMN = "task_dir"


class LookaheadSampler(Sampler[int]):
    """Yields the wrapped sampler's indices unchanged, keeping each epoch's list to read ahead.

    The next epoch is drawn from the wrapped sampler when :meth:`epoch` asks
    for it (at most one epoch early) and served by the next :meth:`__iter__`:
    the wrapped sampler is still iterated once per epoch, in order, so its
    random stream and its order are what they would have been.
    """

    def __init__(self, inner: Sampler[int]) -> None:
        self.inner = inner
        self._current: list[int] = []
        self._upcoming: list[int] | None = None
        #: Epochs begun (how many times :meth:`__iter__` ran).
        self.epochs_begun = 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    # accelerate keeps a sampler's ``generator`` in step across processes (and seeds one it
    # lacks); the wrapped sampler's must stay visible to it, as without the wrapper.
    @property
    def generator(self) -> Any:
        """The wrapped sampler's random generator (``AttributeError`` when it has none)."""
        return self.inner.generator  # type: ignore[attr-defined]

    @generator.setter
    def generator(self, value: Any) -> None:
        self.inner.generator = value  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[int]:
        epoch = self._upcoming if self._upcoming is not None else list(self.inner)
        self._upcoming = None
        self._current = epoch
        self.epochs_begun += 1
        return iter(epoch)

    def epoch(self, ahead: int = 0) -> list[int]:
        """The current epoch's indices (``ahead=0``) or the next one's (``ahead=1``, drawn now if needed)."""
        if ahead == 0:
            return self._current
        if ahead != 1:
            raise ValueError("only the next epoch can be read ahead")
        if self._upcoming is None:
            self._upcoming = list(self.inner)
        return self._upcoming


class GenerationLookahead:
    """Where the current generation batch is in the sampler's order, and the keys of the next one.

    Args:
        sampler: the training sampler, wrapped.
        key: the key of dataset row ``i`` (its task folder), ``None`` for rows without one.
        global_batch: indices per generation over all processes (``generation_batch_size``).
        processes: the number of processes sharing each global batch.
        process_index: this process's slice of it.
        repeat: consecutive copies of each generation batch in the order
            (``num_iterations × steps_per_generation``).
    """

    def __init__(
        self,
        sampler: LookaheadSampler,
        key: Callable[[int], Hashable | None],
        *,
        global_batch: int,
        processes: int = 1,
        process_index: int = 0,
        repeat: int = 1,
    ) -> None:
        if global_batch < 1 or repeat < 1 or processes < 1 or global_batch % processes:
            raise ValueError(
                f"need positive sizes with global_batch a multiple of processes; got global_batch={global_batch}, "
                f"processes={processes}, repeat={repeat}"
            )
        self.sampler = sampler
        self.key = key
        self.local_batch = global_batch // processes
        self.offset = process_index * self.local_batch
        self.stride = global_batch * repeat  # from one generation's batch to the next one's
        self._expected: tuple[int, int] | None = None  # (epochs begun, position) where the next call should be
        #: Whether the last :meth:`next_keys` answer came from the next epoch.
        self.crossed_epoch = False

    def _keys(self, epoch: Sequence[int], position: int) -> list[Hashable | None]:
        begin = position + self.offset
        return [self.key(i) for i in epoch[begin : begin + self.local_batch]]

    def locate(self, keys: Sequence[Hashable | None]) -> int | None:
        """The position in the current epoch of the generation whose local rows have ``keys``, or ``None``.

        The expected position (one generation after the last one found) is
        tried first, so generations with identical keys resolve in order.
        """
        epoch = self.sampler.epoch(0)
        keys = list(keys)
        begun = self.sampler.epochs_begun
        expected = self._expected[1] if self._expected is not None and self._expected[0] == begun else 0
        candidates = [
            expected,
            *(p for p in range(0, len(epoch), self.stride) if p != expected),
        ]
        for position in candidates:
            if position < len(epoch) and self._keys(epoch, position) == keys:
                self._expected = (begun, position + self.stride)
                return position
        self._expected = None
        return None

    def next_keys(self, keys: Sequence[Hashable | None]) -> list[Hashable | None] | None:
        """The next generation's local keys, given the current generation's; ``None`` when it cannot be told."""
        self.crossed_epoch = False
        position = self.locate(keys)
        if position is None:
            return None
        following = position + self.stride
        current = self.sampler.epoch(0)
        if following + self.offset + self.local_batch <= len(current):
            return self._keys(current, following)
        self.crossed_epoch = True
        upcoming = self.sampler.epoch(1)  # the current generation is this epoch's last
        return self._keys(upcoming, 0) if self.offset + self.local_batch <= len(upcoming) else None


def task_key(dataset: Any, column: str = TASK_COLUMN) -> Callable[[int], Hashable | None] | None:
    """Row ``i``'s task folder in ``dataset`` (read once for a 🤗 ``Dataset``), or ``None`` without that column."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if column not in names:
            return None
        values = list(dataset[column])
        return values.__getitem__

    def read(i: int) -> Hashable | None:
        row = dataset[i]
        return row.get(column) if isinstance(row, dict) else None

    return read
