"""A round is released at most once: the same bytes again, never a second training of it."""

import pytest

from nebula_fl.clients.reply_cache import ReplyCache


def test_frames_come_back_byte_for_byte_and_old_ones_shrink_to_markers(tmp_path):
    cache = ReplyCache(root=tmp_path, keep=2)
    assert cache.get("fed", 1) is None and cache.released("fed") == []
    for rnd in (1, 2, 3):
        cache.put("fed", rnd, f"frame {rnd}".encode())
    assert cache.released("fed") == [1, 2, 3]
    assert cache.get("fed", 3) == b"frame 3" and cache.get("fed", 2) == b"frame 2"
    assert cache.get("fed", 1) == b""  # released, no longer kept: a replay is refused, not retrained
    assert cache.released("other") == []
    assert oct((tmp_path / "fed" / "round-000003.frame").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("federation", ["../escape", "a/b", "", "x" * 65, "sp ace"])
def test_a_federation_id_never_names_a_path(tmp_path, federation):
    with pytest.raises(ValueError, match="plain name"):
        ReplyCache(root=tmp_path).put(federation, 1, b"x")


def test_a_round_past_999_999_is_released_and_ordered_after_the_ones_before(tmp_path):
    cache = ReplyCache(root=tmp_path, keep=2)
    for rnd in (999_999, 2_000_000, 12):
        cache.put("fed", rnd, f"frame {rnd}".encode())
    assert (tmp_path / "fed" / "round-2000000.frame").exists()
    assert cache.released("fed") == [12, 999_999, 2_000_000]  # the newest is 2,000,000: 999,999 is the past
    assert cache.get("fed", 2_000_000) == b"frame 2000000" and cache.get("fed", 12) == b""
    (tmp_path / "fed" / "round-0000007.frame").write_bytes(b"x")  # not a name put() writes: not a round
    assert cache.released("fed") == [12, 999_999, 2_000_000]
