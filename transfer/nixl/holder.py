"""The holder side of NIXL: answering pullers' claims and keeping claim windows.

A holder cannot see the READs on its blocks (see `transfer.nixl.notifications`),
so it answers a claim by pinning the request for a claim window W, or says
"expired". A published request's lease defers its expiry until the window
ends (or the release). Offered blocks of a prompt still prefilling
(`transfer.offers`) are claimed the same way; the puller ends such a pull
with "done <rid> <tid>" instead of "release", which closes that claim's
window early and keeps the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from transfer.leases import LeaseTable
from transfer.nixl.endpoint import NixlEndpoint
from transfer.nixl.notifications import EXPIRED, GRANT
from transfer.offers import Offer

logger = logging.getLogger(__name__)


class NixlHolder:
    """Claim answers and windows for the leases and offers of one transceiver.

    Runs on the event loop; it reaches the agent only through jobs on the
    endpoint's thread.
    """

    def __init__(
        self,
        endpoint: NixlEndpoint,
        leases: LeaseTable,
        offers: dict[str, Offer],
        claim_window_s: float,
    ) -> None:
        self._endpoint = endpoint
        self._thread = endpoint.thread
        self._leases = leases
        self._offers = offers
        self._claim_window_s = claim_window_s
        # Claim windows open on offers, oldest first, by (request id, transfer id).
        self._windows: dict[tuple[str, str], deque[tuple[Offer, asyncio.TimerHandle]]] = {}

    def answer_claim(self, puller: str, rid: str, tid: str, metadata: bytes) -> None:
        """Grant a live lease's or offer's blocks to a puller for the claim
        window, or say it expired."""
        lease = self._leases.get(rid, tid)
        offer = self._offers.get(rid)
        ids = [rid.encode(), tid.encode()]
        loop = asyncio.get_running_loop()
        if lease is not None:
            # An expiry meanwhile is deferred until the window ends (or the release).
            self._leases.begin_stream(lease)
            loop.call_later(self._claim_window_s, self._leases.end_stream, lease)
        elif offer is not None and offer.transfer_id == tid:
            # A withdrawal meanwhile waits for the window (or the puller's "done").
            offer.begin_read()
            timer = loop.call_later(self._claim_window_s, self.close_window, rid, tid)
            self._windows.setdefault((rid, tid), deque()).append((offer, timer))
        else:
            self._thread.submit(self._send_answer, puller, metadata, b" ".join([EXPIRED, *ids]))
            return
        answer = b" ".join([GRANT, *ids, repr(self._claim_window_s).encode()])
        self._thread.submit(self._send_answer, puller, metadata, answer)

    def close_window(self, rid: str, tid: str) -> None:
        """End the oldest open claim window on an offer of (rid, tid), if any."""
        windows = self._windows.get((rid, tid))
        if not windows:
            return
        offer, timer = windows.popleft()
        if not windows:
            del self._windows[(rid, tid)]
        timer.cancel()
        offer.end_read()

    def close_all_windows(self) -> None:
        """End every open claim window: the agent is closing, so no READ reaches it."""
        for rid, tid in list(self._windows):
            while (rid, tid) in self._windows:
                self.close_window(rid, tid)

    def _send_answer(self, puller: str, metadata: bytes, answer: bytes) -> None:
        """Agent thread: answer a claim, loading the puller first (again, if it restarted)."""
        try:
            self._endpoint.load_claimant(puller, metadata)
            self._endpoint.agent.send_notif(puller, answer)
        except Exception as exc:  # the puller died; its pull ends by timeout
            self._endpoint.drop_claimant(puller)
            logger.warning("cannot answer the claim of %s: %s", puller, exc)
