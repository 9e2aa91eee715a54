"""Per-uid caps on live requests, built alone: what a uid's live requests name already
comes from plain counters."""

from __future__ import annotations

import pytest

from spanwarm.daemon.caps import UserCaps
from spanwarm.errors import RequestTooLargeError


def _caps(live: dict[int, tuple[int, int]], *, max_bytes: int | None = 1000) -> UserCaps:
    return UserCaps(
        max_bytes=max_bytes,
        max_rows=100,
        exempt=frozenset({0}),
        live_bytes=lambda uid: live.get(uid, (0, 0))[0],
        live_rows=lambda uid: live.get(uid, (0, 0))[1],
    )


def test_a_request_within_its_uids_caps_passes() -> None:
    caps = _caps({1000: (600, 50)})
    caps.check(1000, 400, 50)  # exactly at both caps
    caps.check(1001, 1000, 100)  # another uid's requests do not count


def test_bytes_past_the_cap_counting_the_uids_live_requests_are_refused() -> None:
    with pytest.raises(RequestTooLargeError, match=r"uid 1000.*1000 bytes.*--user-max-bytes"):
        _caps({1000: (600, 0)}).check(1000, 401, 0)


def test_rows_past_the_cap_are_refused_and_a_request_of_no_strided_rows_never_is() -> None:
    caps = _caps({1000: (0, 150)})  # already past (a cap lowered since): nothing strided more
    with pytest.raises(RequestTooLargeError, match=r"more than 100 rows.*--user-max-rows"):
        caps.check(1000, 1, 1)
    caps.check(1000, 1, 0)


def test_exempt_uids_and_no_byte_cap() -> None:
    _caps({0: (10**12, 10**9)}).check(0, 10**12, 10**9)
    _caps({1000: (10**12, 0)}, max_bytes=None).check(1000, 10**12, 0)
