"""Compression of what crosses the WAN: codec chains for adapter updates, both directions.

    layout = Layout.from_arrays(update)                      # names and shapes, in order
    comp = Compressor("topk:0.05+int8", layout=layout)       # one per stream; keeps the EF residual
    blob = comp.encode(layout.flatten(update), seed=round_seed)
    x = Compressor.decode(blob, layout=layout, seed=round_seed)

Built-in codecs: none, fp16, bf16, int8[:BLOCK], int4[:BLOCK] (quantizers) and topk:RATIO,
randk:RATIO, lowrank:RANK (transforms); chains are ``transform+quantizer``. Plugins add codecs
through the ``nebula_fl.codecs`` entry-point group (see Codec for the contract).
"""

from nebula_fl.compression.codec import ArraySpec, Codec, Encoded, Plan
from nebula_fl.compression.compressor import Compressor
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.int4 import Int4  # both widths present for BlockQuantizer.with_param
from nebula_fl.compression.int8 import Int8
from nebula_fl.compression.layout import Layout
from nebula_fl.compression.registry import available_codecs, register_codec
from nebula_fl.compression.spec import parse_spec

__all__ = [
    "ArraySpec",
    "Codec",
    "CodecError",
    "Compressor",
    "Encoded",
    "Int4",
    "Int8",
    "Layout",
    "Plan",
    "available_codecs",
    "parse_spec",
    "register_codec",
]
