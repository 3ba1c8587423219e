"""Mamba scratch slots of speculative verify steps.

A verify step runs a request's last token and its k drafts through the model
at once, but only a prefix of the drafts is accepted, and a Mamba layer's
state must end at the last accepted token. So the verify step keeps the
state after every position: position j (0 = the request's last sampled
token, j = 1..k its drafts) writes its conv and SSM state into scratch slot
j of the request's lane, the last position into the request's own slot:

    position    0        1        ...  k - 1        k
    reads       own      lane[0]       lane[k - 2]  lane[k - 1]
    writes      lane[0]  lane[1]       lane[k - 1]  own

With `a` drafts accepted the state after position `a` is the one that
lives on: `own` already when a = k, else `lane[a]`, which then simply
becomes the request's slot while its old slot takes that place in the lane
(`settle`). Nothing is copied, so no rank ever has to learn of it: every
rank of a tensor-parallel instance runs rank 0's slot ids.

One lane per sequence a step can hold, k slots each, beside the running and
snapshot slots of the same Mamba buffer. Lanes are handed out per step and
all come back when it ran. Pure Python over slot ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.errors import IntegrityError, RequestStateError
from kvcache.mamba_pool import MambaStatePool


class VerifySlots:
    def __init__(self, slots: Sequence[int], depth: int) -> None:
        if depth < 1 or len(slots) % depth:
            raise ValueError(f"{len(slots)} verify slots do not make lanes of {depth}")
        self.depth = depth
        self._lanes = [list(slots[i : i + depth]) for i in range(0, len(slots), depth)]
        self._free = list(range(len(self._lanes)))[::-1]
        self._taken: dict[str, int] = {}  # request -> its lane in the step being built

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    def take(self, request_id: str, num_drafts: int) -> tuple[int, ...] | None:
        """The scratch slots of `num_drafts` draft positions for `request_id`'s
        verify in the step being built; None when every lane is taken."""
        if request_id in self._taken:
            raise RequestStateError(f"request {request_id!r} already verifies in this step")
        if not 1 <= num_drafts <= self.depth:
            raise ValueError(f"a lane holds 1 to {self.depth} drafts, got {num_drafts}")
        if not self._free:
            return None
        lane = self._free.pop()
        self._taken[request_id] = lane
        return tuple(self._lanes[lane][:num_drafts])

    def settle(self, request_id: str, accepted: int, drafted: int, pool: MambaStatePool) -> None:
        """The verify ran and kept `accepted` of `drafted` drafts: the state
        after the last accepted position becomes the request's slot."""
        lane = self._taken.pop(request_id)
        self._free.append(lane)
        if accepted < drafted:
            slots = self._lanes[lane]
            slots[accepted] = pool.replace(request_id, slots[accepted])

    def cancel(self, request_id: str) -> None:
        """The request's verify never ran (preempted while its step was built)."""
        lane = self._taken.pop(request_id, None)
        if lane is not None:
            self._free.append(lane)

    def step_done(self) -> None:
        """Every lane comes back once the step ran (verifies it did not settle
        kept their states where they were)."""
        self._free.extend(self._taken.values())
        self._taken.clear()

    def slots(self) -> list[int]:
        return [slot for lane in self._lanes for slot in lane]

    def check_integrity(self) -> None:
        if self._taken:
            raise IntegrityError("verify slots", [f"lanes still taken: {sorted(self._taken)}"])
