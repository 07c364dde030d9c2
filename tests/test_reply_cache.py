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
