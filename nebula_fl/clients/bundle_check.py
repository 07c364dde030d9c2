"""Which app bundles (FABs) a cluster accepts: configuration for nebula-fl's own apps, and nothing else.

A Flower app bundle is code: a stock SuperNode unpacks it and runs the ClientApp it names. A nebula-fl cluster
runs only the ClientApp of its installed package (clients/runner.py), so a bundle is read as data and must
say so: it holds only a ``pyproject.toml`` (configuration), a licence and Flower's manifest; its components
are nebula-fl's own; it was made for the nebula-fl version this cluster runs (a config key may change meaning
between versions). Anything else is refused in one line before any of it is used.
"""

from __future__ import annotations

import io
import tomllib
import zipfile
from typing import Any

COMPONENTS = {"serverapp": "nebula_fl.server.app:app", "clientapp": "nebula_fl.clients.app:app"}
# What `flwr build` puts in nebula-fl's bundle (fab-include = ["LICENSE"]) and nothing more.
ALLOWED_FILES = frozenset({"pyproject.toml", "LICENSE", ".info/CONTENT"})
MAX_BUNDLE_BYTES = 1 << 20  # uncompressed: nebula-fl's is ~4 KB; a larger one is refused before it is read
VERSION_KEY = "tool.nebula-fl.version"


class BundleRefused(ValueError):
    """The bundle is not one a nebula-fl cluster runs; the message says why in one line."""


def _open(fab: bytes) -> zipfile.ZipFile:
    """The bundle as a zip archive, once its list of files is known to hold nothing but configuration."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(fab))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise BundleRefused(f"the app bundle is not a zip archive ({err})") from None
    names = [info.filename for info in infos]
    extra = sorted(set(names) - ALLOWED_FILES)
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise BundleRefused(f"the app bundle carries {shown}: a nebula-fl bundle holds configuration only "
                            f"({', '.join(sorted(ALLOWED_FILES))}), never code")
    if len(names) != len(set(names)):
        raise BundleRefused("the app bundle names one file twice")
    if "pyproject.toml" not in names:
        raise BundleRefused("the app bundle has no pyproject.toml")
    if sum(info.file_size for info in infos) > MAX_BUNDLE_BYTES:
        raise BundleRefused(f"the app bundle unpacks to more than {MAX_BUNDLE_BYTES} bytes; nebula-fl's is a few KB")
    return archive


def _table(doc: dict[str, Any], dotted: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def read_bundle(fab: bytes) -> dict[str, Any]:
    """The bundle's pyproject.toml as a dict, once the bundle is known to carry nothing else."""
    archive = _open(fab)
    try:
        return tomllib.loads(archive.read("pyproject.toml").decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, zipfile.BadZipFile, OSError) as err:
        raise BundleRefused(f"the app bundle's pyproject.toml is not readable TOML ({err})") from None


def check_bundle(fab: bytes, *, own_version: str) -> dict[str, Any]:
    """Refuse (BundleRefused) any bundle but nebula-fl's own configuration for this version; returns its
    pyproject as a dict. Pure: reads the bytes, never unpacks or runs anything."""
    doc = read_bundle(fab)
    components = _table(doc, "tool.flwr.app.components")
    if components != COMPONENTS:
        raise BundleRefused(f"the app bundle names the components {components!r}; a nebula-fl cluster runs only "
                            f"{COMPONENTS!r}")
    version = _table(doc, VERSION_KEY)
    if not isinstance(version, str):
        raise BundleRefused(f"the app bundle does not say which nebula-fl it was made for ({VERSION_KEY}); build it "
                            "with nebula-fl's launcher or add the key")
    if version != own_version:
        raise BundleRefused(f"the app bundle was made for nebula-fl {version}, this cluster runs {own_version}: "
                            "run the same nebula-fl version on the server and on every cluster")
    return doc
