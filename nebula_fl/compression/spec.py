"""The chain grammar: stages joined by '+', each ``name[:arg]``; at most one transform, then at most one quantizer."""

from __future__ import annotations

import re

from nebula_fl.compression.codec import Codec
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.registry import get_codec

MAX_SPEC = 256
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
_EXAMPLES = "e.g. 'int8', 'topk:0.05+int8' or 'lowrank:4+fp16'"


def parse_spec(spec: str, *, rescan: bool = True) -> tuple[Codec, ...]:
    """Fresh, validated stages of a chain such as 'topk:0.05+int8' (CodecError naming the fix otherwise)."""
    if not isinstance(spec, str):
        raise CodecError(f"a codec spec must be a string ({_EXAMPLES}), got {type(spec).__name__}")
    shown = spec if len(spec) <= 60 else spec[:57] + "..."
    if len(spec) > MAX_SPEC:
        raise CodecError(f"codec spec '{shown}' is {len(spec)} characters, over the {MAX_SPEC}-character limit")
    if not spec.strip():
        raise CodecError(f"codec spec is empty; name a chain, {_EXAMPLES}")
    stages: list[Codec] = []
    for part in spec.split("+"):
        name, colon, arg = part.strip().partition(":")
        if not name:
            raise CodecError(f"codec spec '{shown}' has an empty stage; join stages with one '+', {_EXAMPLES}")
        if not _NAME.match(name):
            raise CodecError(f"codec spec '{shown}': '{name[:40]}' is not a codec name (lower-case letters, "
                             f"digits, '_'); {_EXAMPLES}")
        if colon and not arg.strip():
            raise CodecError(f"codec spec '{shown}': '{name}:' has no argument after the colon; "
                             f"write '{name}' or '{name}:ARG'")
        try:
            stages.append(get_codec(name, rescan=rescan).from_arg(arg.strip() if colon else None))
        except CodecError as exc:
            raise CodecError(f"codec spec '{shown}': {exc}") from None
    _check_chain(shown, stages)
    return tuple(stages)


def _check_chain(shown: str, stages: list[Codec]) -> None:
    if len(stages) > 2:
        raise CodecError(f"codec spec '{shown}' has {len(stages)} stages; a chain is at most one sparsifier or "
                         f"low-rank stage followed by at most one quantizer, {_EXAMPLES}")
    if len(stages) == 2:
        first, second = stages
        if first.role == "quantizer" and second.role == "transform":
            raise CodecError(f"codec spec '{shown}': the quantizer '{first.spec}' must come last, after "
                             f"'{second.spec}' (it compresses the values that stage keeps); write "
                             f"'{second.spec}+{first.spec}'")
        if first.role == second.role == "transform":
            raise CodecError(f"codec spec '{shown}' has two sparsifier/low-rank stages ('{first.spec}', "
                             f"'{second.spec}'); keep one, optionally followed by a quantizer, {_EXAMPLES}")
        if first.role == second.role == "quantizer":
            raise CodecError(f"codec spec '{shown}' has two quantizers ('{first.spec}', '{second.spec}'); "
                             f"keep one, optionally after a sparsifier or low-rank stage, {_EXAMPLES}")


def canonical(stages: tuple[Codec, ...]) -> str:
    """The spec text that parses back to these stages, defaults left out ('int8:256' -> 'int8')."""
    return "+".join(stage.spec for stage in stages)
