"""`nebula-fl server --config server.toml`: the server host's SuperLink, supervised, from one file.

```toml
host = "0.0.0.0"                 # every interface: Flower binds 127.0.0.1 unless told, unreachable from the clusters
port = 8000
work-dir = "/srv/nebula/server"  # the SuperLink's folder: run folders land in runs/ there, logs in logs/
certs = "/etc/nebula/certs"      # ca.crt, server.crt, server.key (nebula-fl certs); or insecure = true
database = "superlink.db"        # in work-dir unless absolute: SuperNode registrations survive a restart
health = "127.0.0.1:9101"        # GET /health: 200 while the SuperLink runs, else 503 (optional)
register = ["/etc/nebula/certs/cluster-0.pub", "/etc/nebula/certs/cluster-1.pub"]  # admitted once it listens
```

With TLS the SuperLink admits only registered SuperNodes (`--enable-supernode-auth`); the keys listed are
registered every time it starts (a key it already holds is fine). The ServerApp of each run is nebula-fl's, run
with this host's install; `nebula-fl submit` from anywhere reports where its run folder is.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from nebula_fl.deploy.health import parse_address
from nebula_fl.deploy.site_config import read_toml
from nebula_fl.deploy.site_config import typed as typed_value
from nebula_fl.deploy.supervisor import Service
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.federation import _bin, child_env
from nebula_fl.launcher.plan import port_free

SERVER_KEYS = {"host", "port", "work-dir", "certs", "insecure", "database", "health", "register"}
LISTEN_S = 60.0


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    path: Path
    work_dir: Path
    host: str = "0.0.0.0"
    port: int = 8000
    certs: Path | None = None
    insecure: bool = False
    database: Path | None = None
    health: str | None = None
    register: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        where = str(self.path)
        if not 0 < self.port < 65536:
            raise NebulaError(f"{where}: port = {self.port} is not a port (1-65535)")
        if self.health is not None:
            parse_address(self.health, where=f"{where}: health")
        if self.insecure and (self.certs or self.register):
            raise NebulaError(f"{where}: insecure = true with certs or register; an insecure SuperLink admits any "
                              "SuperNode, so drop them, or drop insecure")
        if not self.insecure:
            if self.certs is None:
                raise NebulaError(f"{where}: certs is missing; TLS needs the folder `nebula-fl certs` wrote, or set "
                                  "insecure = true on a trusted network")
            missing = [n for n in ("ca.crt", "server.crt", "server.key") if not (self.certs / n).is_file()]
            if missing:
                raise NebulaError(f"{where}: certs = '{self.certs}' lacks {missing[0]}; make the set with "
                                  f"`nebula-fl certs {self.certs} --hosts 127.0.0.1,<this host's names>`")
        for key in self.register:
            if not key.is_file():
                raise NebulaError(f"{where}: register: '{key}' does not exist")

    @classmethod
    def load(cls, path: Path) -> ServerConfig:
        path = Path(path).expanduser().resolve()
        doc = read_toml(path, what="server", known=SERVER_KEYS)
        if "work-dir" not in doc:
            raise NebulaError(f"{path}: 'work-dir' is missing (where run folders and logs go)")

        def typed(key: str, kind: type, default: Any = None) -> Any:
            return typed_value(doc, key, kind, default, path=path)

        def resolved(value: str, base: Path) -> Path:
            return (base / value).expanduser().resolve()

        work = resolved(typed("work-dir", str), path.parent)
        register = typed("register", list, [])
        if not all(isinstance(k, str) for k in register):
            raise NebulaError(f"{path}: register must list key file paths")
        return cls(path=path, work_dir=work, host=typed("host", str, "0.0.0.0"), port=typed("port", int, 8000),
                   certs=resolved(typed("certs", str), path.parent) if "certs" in doc else None,
                   insecure=typed("insecure", bool, False),
                   database=resolved(typed("database", str), work) if "database" in doc else None,
                   health=typed("health", str), register=[resolved(k, path.parent) for k in register])


def server_services(cfg: ServerConfig) -> list[Service]:
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    home = cfg.work_dir / "flwr"
    home.mkdir(exist_ok=True)
    env = child_env(home)
    local = ({"address": f"127.0.0.1:{cfg.port}", "insecure": True} if cfg.insecure else
             {"address": f"127.0.0.1:{cfg.port}", "root-certificates": str(cfg.certs / "ca.crt")})
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "local", "local": local}}))
    tls = (["--insecure"] if cfg.insecure else
           ["--ssl-ca-certfile", str(cfg.certs / "ca.crt"), "--ssl-certfile", str(cfg.certs / "server.crt"),
            "--ssl-keyfile", str(cfg.certs / "server.key"), "--enable-supernode-auth"])
    argv = [_bin("flower-superlink"), *tls, "--disable-runtime-dependency-installation", "--host", cfg.host,
            "--port", str(cfg.port), *(["--database", str(cfg.database)] if cfg.database else [])]

    def register() -> str | None:
        deadline = time.monotonic() + LISTEN_S
        while port_free(cfg.port):
            if time.monotonic() > deadline:
                raise NebulaError(f"the SuperLink did not listen on port {cfg.port} within {LISTEN_S:.0f} s "
                                  f"(its log: {cfg.work_dir / 'logs' / 'superlink.log'})")
            time.sleep(0.2)
        for key in cfg.register:
            done = subprocess.run([_bin("flwr"), "supernode", "register", str(key), "local"], env=env,
                                  capture_output=True, text=True, timeout=120)
            said = (done.stdout + done.stderr).strip()
            if done.returncode != 0 and "already" not in said.lower():
                raise NebulaError(f"registering '{key}' failed: {said.splitlines()[-1] if said else done.returncode}")
        return f"listening on {cfg.host}:{cfg.port}; {len(cfg.register)} SuperNode key(s) registered"

    return [Service(name="superlink", argv=argv, env=env, cwd=cfg.work_dir, after_start=register)]


def describe(cfg: ServerConfig) -> str:
    link = "insecure (plain HTTP)" if cfg.insecure else f"TLS ({cfg.certs}), registered SuperNodes only"
    return (f"server: SuperLink on {cfg.host}:{cfg.port}, {link}; run folders in {cfg.work_dir / 'runs'}, logs in "
            f"{cfg.work_dir / 'logs'}" + (f", registrations in {cfg.database}" if cfg.database else
                                          " (registrations in memory: set database to keep them)")
            + (f", health http://{cfg.health}/health" if cfg.health else ""))
