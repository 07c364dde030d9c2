"""Exact payload accounting: the bytes Flower serializes for a message, not numel x 4.

Flower 1.42 sends a message as a tree of content-addressed objects (message, record dict, records,
arrays, array chunks); each distinct object crosses once, as its deflated bytes. Summing those is
what one node uploads or downloads for the message, before HTTP framing.
"""

from __future__ import annotations

from flwr.app import Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects


def payload_bytes(message: Message) -> int:
    """Serialized size of `message`: every distinct object of its tree, deflated, once."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
