"""A site's one config file: the cluster's trainer, its SuperNode and ClientApp runner, logs and health.

```toml
cluster-id = 0
superlink = "server.example.org:8000"   # the SuperLink's address, as its certificate names it
state-dir = "/srv/nebula/site-0"          # the trainer's state, the SuperNode's secret; logs/ unless log-dir
ca = "/etc/nebula/ca.crt"                 # TLS: the federation's CA ...
node-key = "/etc/nebula/cluster-0"        # ... and this cluster's SuperNode key (nebula-fl certs); or insecure = true
health = "127.0.0.1:9100"                 # GET /health: 200 when all three run, else 503 (optional)

[trainer]   # `nebula-fl trainer` flags by their long names, checked as the flags are
data = "/data/news"
workers = 4
device = "cuda"
privacy-mode = "sample"
target-epsilon = 8
planned-rounds = 20
planned-local-steps = 10
```

Every key is checked when the file is read, with the same bounds and one-line errors as the flags, so a typo
stops the site before anything starts. A cluster across machines runs a site on each: `nnodes`, `node-rank` and
`rendezvous` under [trainer]; a node other than 0 runs the trainer only (node 0's SuperNode serves the cluster).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_fl.deploy.health import parse_address
from nebula_fl.errors import NebulaError

SITE_KEYS = {"cluster-id", "superlink", "state-dir", "log-dir", "ca", "node-key", "insecure", "health",
             "runtime-port", "trainer"}
SET_BY_SITE = {"socket", "cluster-id", "state-dir"}  # [trainer] keys the site itself decides


def read_toml(path: Path, *, what: str, known: frozenset[str] | set[str], hint: str = "") -> dict[str, Any]:
    """The file's table, every top-level key among `known` (`hint` says where an unknown one may belong)."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise NebulaError(f"{path}: no such {what} config; pass the file you wrote (examples/sites/)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise NebulaError(f"{path}: the {what} config cannot be read ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise NebulaError(f"{path}: the {what} config is not valid TOML: {err}") from None
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise NebulaError(f"{path}: unknown key '{unknown[0]}'{hint}; known: {', '.join(sorted(known))}")
    return doc


def typed(doc: dict[str, Any], key: str, kind: type, default: Any = None, *, path: Path) -> Any:
    """`doc[key]` (or `default`) if it is a `kind` (a bool is not an int); else one line naming the file and key."""
    value = doc.get(key, default)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise NebulaError(f"{path}: {key} = {value!r} must be {kind.__name__}")
    return value


def _flags(table: dict[str, Any], *, where: str) -> list[str]:
    """A table of `--flag value` pairs by long name: true is the bare flag, false leaves it out."""
    argv: list[str] = []
    for key, value in table.items():
        if isinstance(value, bool):
            argv += [f"--{key}"] if value else []
        elif isinstance(value, str | int | float):
            argv += [f"--{key}", str(value)]
        else:
            raise NebulaError(f"{where}: {key} = {value!r} is not a string, number or true/false")
    return argv


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    path: Path
    cluster_id: int
    superlink: str
    state_dir: Path
    log_dir: Path
    insecure: bool = False
    ca: Path | None = None
    node_key: Path | None = None
    health: str | None = None
    runtime_port: int = 9094
    trainer_flags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        where = str(self.path)
        if self.cluster_id < 0:
            raise NebulaError(f"{where}: cluster-id = {self.cluster_id}; a cluster id is 0 or more")
        if self.node_rank > 0:  # the trainer only: no SuperNode, no link to the SuperLink
            return
        if not self.superlink:
            raise NebulaError(f"{where}: 'superlink' is missing (node 0 of a cluster runs its SuperNode)")
        parse_address(self.superlink, where=f"{where}: superlink")
        if self.health is not None:
            parse_address(self.health, where=f"{where}: health")
        if not 0 < self.runtime_port < 65536:
            raise NebulaError(f"{where}: runtime-port = {self.runtime_port} is not a port (1-65535)")
        if self.insecure and (self.ca or self.node_key):
            raise NebulaError(f"{where}: insecure = true with ca or node-key; drop one or the other")
        if not self.insecure:
            for key, value in (("ca", self.ca), ("node-key", self.node_key)):
                if value is None:
                    raise NebulaError(f"{where}: {key} is missing; TLS needs the federation's CA and this cluster's "
                                      "SuperNode key (nebula-fl certs), or set insecure = true on a trusted network")
                if not value.is_file():
                    raise NebulaError(f"{where}: {key} = '{value}' does not exist")

    @property
    def node_rank(self) -> int:
        """This machine's place in a cluster across machines ([trainer] node-rank; 0 serves the SuperNode)."""
        flags = self.trainer_flags
        return int(flags[flags.index("--node-rank") + 1]) if "--node-rank" in flags else 0

    @classmethod
    def load(cls, path: Path) -> SiteConfig:
        path = Path(path).expanduser().resolve()
        doc = read_toml(path, what="site", known=SITE_KEYS, hint=" (a trainer flag goes under [trainer])")
        for key in ("cluster-id", "state-dir"):
            if key not in doc:
                raise NebulaError(f"{path}: '{key}' is missing")
        trainer = doc.get("trainer", {})
        if not isinstance(trainer, dict):
            raise NebulaError(f"{path}: trainer must be a table ([trainer])")
        taken = sorted(set(trainer) & SET_BY_SITE)
        if taken:
            raise NebulaError(f"{path}: [trainer] {taken[0]} is set by the site itself; drop it")
        flags = _flags(trainer, where=f"{path}: [trainer]")  # their values: checked by the CLI's own parser

        def _path(key: str) -> Path | None:
            value = doc.get(key)
            if value is None:
                return None
            if not isinstance(value, str) or not value:
                raise NebulaError(f"{path}: {key} must be a path (a string)")
            return (path.parent / value).expanduser().resolve()

        def _typed(key: str, kind: type, default: Any = None) -> Any:
            return typed(doc, key, kind, default, path=path)

        state_dir = _path("state-dir")
        assert state_dir is not None
        return cls(path=path, cluster_id=_typed("cluster-id", int), superlink=_typed("superlink", str) or "",
                   state_dir=state_dir, log_dir=_path("log-dir") or state_dir / "logs",
                   insecure=_typed("insecure", bool, False), ca=_path("ca"), node_key=_path("node-key"),
                   health=_typed("health", str), runtime_port=_typed("runtime-port", int, 9094),
                   trainer_flags=flags)
