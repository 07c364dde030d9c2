"""A train request is parsed once, and what is not a request is refused in one line naming only what was sent."""

import pytest

from nebula_fl.clients.round_request import BadRequest, RoundRequest


def test_a_request_is_parsed_once_into_what_every_stage_reads():
    config = {"federation-id": "fed_1", "server-round": 3, "secagg-epoch": "e", "codec-up": "randk:0.1"}
    req = RoundRequest.parse({"config": config, "arrays": {"blob": b""}, "secagg": {"stage": "unmask"}})
    assert (req.federation, req.number, req.masked, req.codec_up) == ("fed_1", 3, True, "randk:0.1")
    assert req.riding == {"stage": "unmask"} and req.arrays == {"blob": b""} and req.config is config
    plain = RoundRequest.parse({"config": {"federation-id": "f", "server-round": 1}})
    assert (plain.masked, plain.codec_up, plain.riding, plain.arrays) == (False, None, None, {})


@pytest.mark.parametrize(("header", "said"), [
    ({}, "the request has no config object"),
    ({"config": [1]}, "the request has no config object"),
    ({"config": {"federation-id": "../x", "server-round": 1}}, "federation id '../x' is not a plain name"),
    ({"config": {"federation-id": 7, "server-round": 1}}, "federation id 7 is not a plain name"),
    ({"config": {"federation-id": "f", "server-round": True}}, "server-round True is not a round number"),
    ({"config": {"federation-id": "f", "server-round": 0}}, "server-round 0 is not a round number"),
    ({"config": {"federation-id": "f", "server-round": "2"}}, "server-round '2' is not a round number"),
])
def test_what_is_not_a_request_is_refused_in_one_line(header, said):
    with pytest.raises(BadRequest) as err:
        RoundRequest.parse(header)
    assert str(err.value).startswith(said) and "\n" not in str(err.value)
