"""The notifications a NIXL holder and puller exchange, and why a claim makes READs safe.

Each is one NIXL notification, words joined by single spaces:

    claim <rid> <tid> <metadata>        puller -> holder, before its READs
    grant <rid> <tid> <W>               holder -> puller: pinned for W seconds
    expired <rid> <tid>                 holder -> puller: the lease is over
    release <rid> <tid> <rank> <of>     puller rank -> holder: all READs done
    release <rid> <tid>                 puller -> holder: the pull was aborted
    done <rid> <tid>                    puller -> holder: READs of offered blocks
                                        are over; the holder keeps the request

READs are one-sided, so the holder cannot see them. The puller claims the
request and posts its READs without waiting for the answer; the holder,
whose monotonic clock alone decides whether the lease is still live, answers
"expired" or pins the blocks for a window W past the lease. A lease never
comes back, so a grant means the blocks held the request's bytes from
publish until the answer and stay pinned for W after: READs done within the
window read the request. The puller counts W on its own monotonic clock from
*before* it sent the claim, so its window closes before the holder's does
whatever the two clocks read (only their rates must agree); READs not done
by then are released and the pull fails with `UnknownRequest`, as it does on
"expired" once its READs are over (what they brought lands only in blocks the
caller frees). A holder that aborts a request while a READ is in flight still
cannot stop it.
"""

from __future__ import annotations

RELEASE = b"release"
CLAIM = b"claim"
GRANT = b"grant"
EXPIRED = b"expired"
DONE = b"done"  # READs of offered blocks finished; the holder keeps the request
