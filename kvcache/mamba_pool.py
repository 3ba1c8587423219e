"""Slots of Mamba conv/SSM state: one slot per running request of a hybrid model.

Unlike KV blocks, Mamba state does not grow with the sequence: a request holds
exactly one slot (every Mamba layer's conv and SSM state) from its first
prefill chunk to its end. A freshly allocated slot holds whatever its previous
owner left; the model runner starts a new prefill from a zero state rather
than reading it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvcache.errors import IntegrityError, RequestStateError
from kvcache.layout import CONV, MAMBA_KINDS, SSM
from kvcache.spec import CacheSpec

# The SSM state accumulates over the whole sequence; bf16 would drift, so it is
# float32 whatever the KV cache dtype.
SSM_DTYPE = "float32"


@dataclass(frozen=True)
class MambaStateShape:
    """One Mamba layer's conv or SSM state in one slot."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    num_bytes: int


def mamba_state_shape(spec: CacheSpec, kind: str) -> MambaStateShape:
    """conv: `(conv_dim, conv_kernel - 1)` in the cache dtype; ssm: `(num_heads,
    head_dim, state_size)` in float32."""
    if kind == CONV:
        return MambaStateShape(CONV, spec.dtype, spec.conv_state_shape, spec.conv_state_bytes)
    if kind == SSM:
        return MambaStateShape(SSM, SSM_DTYPE, spec.ssm_state_shape, spec.ssm_state_bytes)
    raise ValueError(f"Mamba state kind must be one of {MAMBA_KINDS}, got {kind!r}")


class MambaStatePool:
    """Pure-Python bookkeeping of `num_slots` slot ids, `0 .. num_slots - 1`
    at first; `exchange` may swap one for a snapshot store's slot."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a Mamba state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owner: dict[str, int] = {}
        self._ids = set(range(num_slots))
        # A pinned slot is the source of a state copy still to run (a fork,
        # `kvcache.fork`): freed meanwhile, it is parked, not reused.
        self._pins: dict[int, int] = {}
        self._parked: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int | None:
        """Give `request_id` a slot; None when all slots are taken.

        Raises RequestStateError when the request already holds one.
        """
        if request_id in self._owner:
            raise RequestStateError(
                f"request {request_id!r} already holds Mamba slot {self._owner[request_id]}"
            )
        if not self._free:
            return None
        slot = self._free.popleft()
        self._owner[request_id] = slot
        return slot

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def free(self, request_id: str) -> None:
        """Return the request's slot; a no-op for a request without one."""
        slot = self._owner.pop(request_id, None)
        if slot is None:
            return
        if slot in self._pins:
            self._parked.add(slot)
        else:
            self._free.append(slot)

    def pin(self, slot: int) -> None:
        """Keep `slot`'s state from reuse until `unpin` (a copy reads it later)."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        """Drop one pin; a slot freed while pinned becomes free now."""
        count = self._pins.pop(slot) - 1
        if count:
            self._pins[slot] = count
        elif slot in self._parked:
            self._parked.discard(slot)
            self._free.append(slot)

    def exchange(self, request_id: str, replacement: int) -> int:
        """End `request_id`'s ownership without freeing its slot (a snapshot
        store keeps the state in it) and take `replacement` as a free slot
        instead. Returns the request's slot."""
        slot = self._owner.pop(request_id)
        self._ids.discard(slot)
        self._ids.add(replacement)
        self._free.append(replacement)
        return slot

    def replace(self, request_id: str, slot: int) -> int:
        """Give `request_id` the slot `slot` from outside the pool (a verify
        lane's, which holds its state now) in place of its own, which is
        returned and leaves the pool."""
        old = self._owner[request_id]
        if slot in self._ids:
            raise RequestStateError(f"slot {slot} is already one of the pool's")
        self._owner[request_id] = slot
        self._ids.discard(old)
        self._ids.add(slot)
        return old

    def free_slots(self) -> list[int]:
        """Slots no request owns: free ones and parked ones (freed while pinned)."""
        return [*self._free, *self._parked]

    def owners(self) -> dict[str, int]:
        return dict(self._owner)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every slot is either free or owned, once."""
        problems: list[str] = []
        owned = list(self._owner.values())
        free = list(self._free)
        parked = list(self._parked)
        if not self._parked <= set(self._pins):
            problems.append(f"parked slots {sorted(self._parked - set(self._pins))} are not pinned")
        if len(set(owned)) != len(owned):
            problems.append(f"a slot is owned twice: {sorted(owned)}")
        if len(set(free)) != len(free):
            problems.append(f"a slot is free twice: {sorted(free)}")
        if set(owned) & set(free):
            problems.append(f"slots both free and owned: {sorted(set(owned) & set(free))}")
        if sorted(owned + free + parked) != sorted(self._ids) or len(self._ids) != self.num_slots:
            problems.append(
                f"free {len(free)} + owned {len(owned)} + parked {len(parked)} slots "
                f"do not cover its {self.num_slots}"
            )
        if problems:
            raise IntegrityError("Mamba state pool", problems)
