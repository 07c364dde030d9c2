"""A lying server that *searches* schedules against real cluster stages (SecAggStage), and what it then knows.

`Run` plays a schedule — a list of steps, each one message the server sends — on n real stages restored from a
cached key setup (`Setup`, state_dict copies: no re-keying per schedule), and records everything the server holds:
every upload (masked bytes, commitments, receipts, published next keys), every sealed share, every reply. The steps
(`Train`, `NextKey`, `Sign`, `Unmask` (explicit or riding on a train message), `Recover`, `Replay`) cover what the
server chooses: the round set, who gets a train message, which key of each neighbour it names ("secagg-keys": the
right one, a stale one of another round with its number or relabelled, none, the bare round), per-holder views and
who signs them, which sealed self shares it forwards to whom, recover requests for any cluster and round, at once or
deferred, next-key requests for any round, earlier requests replayed with their round or epoch changed. Colluding
clusters: the server reads their state (key shares, own keys, own self-share pieces), unseals every share sealed to
them with their channel key, and signs any view in their name.

`analyse` computes the server's knowledge from the real bytes: every self seed with t or more shares (revealed, or
a colluder's) rebuilt with rebuild.rebuild and checked against the upload's commitment; every mask key likewise,
checked against its published public half; every revealed pair key matched to the commitments; then from every
private key it knows (rebuilt, or a colluder's) the pair keys of every public key seen, for every epoch, round and
pair of key numbers, kept where they match an upload's commitment. Those symbols go to the closure checker
(tests/secagg_closure.py); every single update it reports determined, and every sub-threshold sum with integer
coefficients, is then *computed* from the real uploads and compared with the truth (one quantisation step per term):
a finding is a real recovery, not a model of one. (`analyse(thorough=False)`, the fast tier's: a self seed with t
shares counts as known unrebuilt, more than the truth, and only a run with a finding is rebuilt for real.)

The search: `random_schedule` (seeded) and `sweep` (exhaustive over a structured space of per-round moves, played
as a tree so that schedules sharing their first rounds share their execution). `issue30_schedule` is the fixed
regression of issue 30 (round 1: target j and helpers A, only j's sealed self share forwarded, to A; rounds 2..t:
each a in A certified dropped, its key's recovery deferred to the end), with the stale-key variant the first driver
found (the others named a's key of round 1). With `rotate_keys=False` (the control: one mask key, the setup's, for
every round of an epoch) the search must find real recoveries; with the protocol, nothing below the threshold.

Speed: a schedule costs 20-100 ms of one core. Setups are cached (`Setup.get`) and each run starts from state_dict
copies, with the next keys of rounds 2-4 asked for at setup (`PREMADE`; a server may ask any time), so the Shamir
rebuilds of the same key shares are memoised across schedules; every stage still writes and fsyncs its state file
before it replies.

    .venv/bin/python -m tests.secagg_campaign    # the fixed schedules and a short search, control and protocol
    .venv/bin/python -m tests.secagg_campaign_report --quick
"""

from __future__ import annotations

import atexit
import base64
import copy
import itertools
import json
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.secagg import evidence, graph, shares
from nebula_fl.secagg import field as ff
from nebula_fl.secagg.identity import Identity
from nebula_fl.secagg.masks import expand, pair_sign, round_key
from nebula_fl.secagg.rebuild import rebuild
from nebula_fl.secagg.shares import ShareError
from nebula_fl.secagg.wire import commitment, digest, unpack_upload
from tests.secagg_closure import Report, Upload, closure

FED = "fed1"
BITS, COORDS, CLIP, MAX_WEIGHT = 32, 6, 1.0, 100
EPOCHS = {"e1": 1, "e2": 2}  # epoch id -> its first round (e2's rounds share numbers with e1's on purpose)
ROUNDS = 3  # rounds of e1 a schedule plays (e2: 2)
PREMADE = {"e1": (2, 3, 4), "e2": (3,)}  # next keys asked for at setup (the server may ask for any round, any time)


# -- settings and cached setups ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    n: int
    t: int
    num_shares: int = 0  # 0: complete graph
    colluders: tuple[str, ...] = ()
    rotate: bool = True  # False: the control (one mask key an epoch)
    epochs: int = 1
    premade: bool = True

    @property
    def ids(self) -> list[str]:
        return [str(i) for i in range(self.n)]

    @property
    def label(self) -> str:
        extra = f", num-shares {self.num_shares}" if self.num_shares else ""
        extra += f", colluders {','.join(self.colluders)}" if self.colluders else ""
        extra += ", 2 epochs" if self.epochs > 1 else ""
        extra += "" if self.premade else ", keys made as uploads go"
        return f"n={self.n} t={self.t}{extra} ({'protocol' if self.rotate else 'control'})"


@dataclass(frozen=True)
class EpochInfo:
    eid: str
    first: int
    setup: str  # the setup digest every signature binds
    s_pks: dict[str, str]
    c_pks: dict[str, str]
    neighbours: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class UploadRec:
    cluster: str
    eid: str
    round: int
    round_set: tuple[str, ...]
    masked: bytes
    head: dict[str, Any]
    code: ff.FieldCode
    values: np.ndarray
    weight: int

    @property
    def vector(self) -> np.ndarray:
        return ff.unpack(self.masked, bits=self.code.bits, count=COORDS + 1)


@dataclass
class Memory:
    """Everything the server holds: what it sent and what came back."""

    sealed: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)  # (epoch, holder) -> key id -> token
    pubs: dict[tuple[str, str, int], list[Any]] = field(default_factory=dict)  # (epoch, owner, round) -> [r, pk, sig]
    uploads: dict[tuple[str, int], dict[str, UploadRec]] = field(default_factory=dict)
    round_sets: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)  # as the first Train named it
    sigs: dict[tuple[str, int, tuple[str, ...], tuple[str, ...]], dict[str, str]] = field(default_factory=dict)
    reveals: list[tuple[str, str, int, str, dict[str, Any]]] = field(default_factory=list)  # kind, epoch, round, holder
    requests: list[tuple[str, str, dict[str, Any]] | None] = field(default_factory=list)  # per step: kind, holder, req
    outcomes: list[str] = field(default_factory=list)  # one line per message


_SCRATCH: list[Path] = []


def _scratch() -> Path:
    """One folder for every cached setup's stage state, on tmpfs when there is one (each reply fsyncs its state)."""
    if not _SCRATCH:
        shm = Path("/dev/shm")
        folder = Path(tempfile.mkdtemp(prefix="nebula-campaign-", dir=shm if shm.is_dir() else None))
        atexit.register(shutil.rmtree, folder, True)
        _SCRATCH.append(folder)
    return _SCRATCH[0]


class Setup:
    """n real stages with one (or two) key epochs set up, their state saved: every schedule starts from a copy."""

    _cache: ClassVar[dict[tuple[Any, ...], Setup]] = {}

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        ids = setting.ids
        folder = Path(tempfile.mkdtemp(prefix=f"n{setting.n}t{setting.t}-", dir=_scratch()))
        roster = {c: Identity.load_or_create(folder / f"c{c}" / "secagg").public for c in ids}
        self.stages = {c: SecAggStage(state_dir=folder / f"c{c}", cluster_id=int(c), roster=roster,
                                      rotate_keys=setting.rotate) for c in ids}
        self.memory = Memory()
        self.epochs: dict[str, EpochInfo] = {}
        for eid in list(EPOCHS)[: setting.epochs]:
            first = EPOCHS[eid]
            keys = {c: s.handle({"stage": "keys", "federation-id": FED, "epoch": eid, "round": first})
                    for c, s in self.stages.items()}
            request = {"stage": "share", "federation-id": FED, "epoch": eid, "members": ids, "round": first,
                       "c-pks": [keys[c]["c-pk"] for c in ids], "s-pks": [keys[c]["s-pk"] for c in ids],
                       "id-pks": [keys[c]["id-pk"] for c in ids], "key-sigs": [keys[c]["key-sig"] for c in ids],
                       "num-shares": setting.num_shares, "threshold": setting.t}
            for c, stage in self.stages.items():
                reply = stage.handle(dict(request))
                for holder, token in zip(reply["to"], reply["tokens"]):
                    self.memory.sealed.setdefault((eid, holder), {})[f"{c}/{first}"] = token
            state = self.stages[ids[0]].state_dict()[FED]["epochs"][eid]
            self.epochs[eid] = EpochInfo(
                eid=eid, first=first, setup=state["setup_digest"], s_pks={c: keys[c]["s-pk"] for c in ids},
                c_pks={c: keys[c]["c-pk"] for c in ids},
                neighbours=graph.neighbours(ids, num_shares=setting.num_shares, seed=eid))
            if setting.rotate and setting.premade:
                for rnd in PREMADE[eid]:
                    for c, stage in self.stages.items():
                        pub = stage.handle({"stage": "next-key", "federation-id": FED, "epoch": eid, "round": rnd})
                        take_key(self.memory, eid, c, pub)
        self.states = {c: s.state_dict() for c, s in self.stages.items()}

    @classmethod
    def get(cls, setting: Setting) -> Setup:
        key = (setting.n, setting.t, setting.num_shares, setting.rotate, setting.epochs, setting.premade)
        if key not in cls._cache:
            cls._cache[key] = cls(setting)
        return cls._cache[key]


def take_key(memory: Memory, eid: str, owner: str, pub: dict[str, Any]) -> None:
    """A published mask key (an upload's next-key or a next-key reply): its signed public half and sealed shares."""
    seq = int(pub["seq"])
    memory.pubs[(eid, owner, seq)] = [seq, pub["pk"], pub["sig"]]
    for holder, token in zip(pub["to"], pub["tokens"]):
        memory.sealed.setdefault((eid, holder), {})[f"{owner}/{seq}"] = token


# -- the server's moves --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Train:
    """Train messages of `round` to `uploaders` (each masks and uploads) under `round_set`. `naming`: (recipient or
    "*", owner, how) with how one of "stale:k" (owner's key of round k, as published), "relabel:k" (that key, named
    as this round's), "missing", "bare" ([round] alone); everyone else is named the owner's key of this round."""

    eid: str
    round: int
    round_set: tuple[str, ...]
    uploaders: tuple[str, ...]
    naming: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class NextKey:
    eid: str
    cluster: str
    round: int


@dataclass(frozen=True)
class Sign:
    """Ask `signers` to sign the view (survivors; dropped: the rest of the round set). Colluders sign anything."""

    eid: str
    round: int
    survivors: tuple[str, ...]
    signers: tuple[str, ...]


@dataclass(frozen=True)
class Unmask:
    """Ask `holder` to unmask `round` under the view `survivors`, with every signature of that view the server holds
    and every receipt; `forward`: "all", "none" or the owners whose sealed self share (to this holder) it forwards.
    `riding`: as the answer_riding of a train message instead of an explicit request."""

    eid: str
    round: int
    holder: str
    survivors: tuple[str, ...]
    forward: str | tuple[str, ...] = "all"
    riding: bool = False


@dataclass(frozen=True)
class Recover:
    eid: str
    round: int
    holder: str
    clusters: tuple[str, ...]


@dataclass(frozen=True)
class Replay:
    """The request of step `step` again, to its holder, with its round and/or epoch changed."""

    step: int
    round: int | None = None
    eid: str | None = None


Step = Train | NextKey | Sign | Unmask | Recover | Replay


@dataclass(frozen=True)
class Schedule:
    label: str
    steps: tuple[Step, ...]

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "steps": [{"do": type(s).__name__, **asdict(s)} for s in self.steps]}

    def __str__(self) -> str:
        return self.label + "\n" + "\n".join(f"  {i:2d}. {s}" for i, s in enumerate(self.steps))


# -- playing a schedule on the real stages -------------------------------------------------------------------------
class Run:
    def __init__(self, setting: Setting, *, seed: int = 0) -> None:
        self.setting = setting
        self.setup = Setup.get(setting)
        self.stages = self.setup.stages
        self.epochs = self.setup.epochs
        self.memory = copy.deepcopy(self.setup.memory)
        self.steps: list[Step] = []
        self.rng = np.random.default_rng(seed)
        for c, stage in self.stages.items():
            stage.load_state_dict(self.setup.states[c])

    # -- forking (the sweep's tree: schedules that share their first steps share their execution) --
    def save(self) -> tuple[Any, ...]:
        return ({c: s.state_dict() for c, s in self.stages.items()}, copy.deepcopy(self.memory), list(self.steps),
                copy.deepcopy(self.rng.bit_generator.state))

    def restore(self, saved: tuple[Any, ...]) -> None:
        states, memory, steps, rng = saved
        for c, stage in self.stages.items():
            stage.load_state_dict(states[c])
        self.memory, self.steps = copy.deepcopy(memory), list(steps)
        self.rng.bit_generator.state = copy.deepcopy(rng)

    def play(self, steps: Iterable[Step]) -> Run:
        for step in steps:
            self.steps.append(step)
            request = None
            try:
                request = getattr(self, f"_{type(step).__name__.lower()}")(step)
            finally:
                self.memory.requests.append(request)
        return self

    def _send(self, kind: str, holder: str, request: dict[str, Any], *, riding: bool = False) -> dict[str, Any] | None:
        """One request to one stage; its reply, or None (the refusal or error is logged)."""
        what = f"{kind} {request.get('epoch')}/r{request.get('round')} -> {holder}"
        try:
            reply = self.stages[holder].answer_riding(request) if riding else self.stages[holder].handle(request)
        except SecAggRefusal as err:
            self.memory.outcomes.append(f"{what}: refused: {err}")
            return None
        except Exception as err:  # anything but a refusal is a robustness finding, logged
            self.memory.outcomes.append(f"{what}: ERROR {type(err).__name__}: {err}")
            return None
        if "refused" in reply:
            self.memory.outcomes.append(f"{what}: refused: {reply['refused']}")
            return None
        self.memory.outcomes.append(f"{what}: ok")
        return reply

    def _nextkey(self, step: NextKey) -> tuple[str, str, dict[str, Any]]:
        request = {"stage": "next-key", "federation-id": FED, "epoch": step.eid, "round": step.round}
        if (reply := self._send("next-key", step.cluster, request)) is not None:
            take_key(self.memory, step.eid, step.cluster, reply)
        return ("next-key", step.cluster, request)

    def key_entry(self, eid: str, owner: str, rnd: int) -> list[Any]:
        """The server's name for `owner`'s mask key of `rnd` ("secagg-keys"): [rnd] for the epoch's first round (and in
        the control), else its publication, asked for with next-key when the server lacks it (as the honest server)."""
        if rnd == self.epochs[eid].first or not self.setting.rotate:
            return [rnd]
        if (eid, owner, rnd) not in self.memory.pubs:
            self._nextkey(NextKey(eid, owner, rnd))
        return list(self.memory.pubs.get((eid, owner, rnd), [rnd]))

    def _named(self, step: Train, recipient: str) -> dict[str, list[Any]]:
        info = self.epochs[step.eid]
        named = {}
        for m in step.round_set:
            if m != recipient and m not in info.neighbours[recipient]:
                continue
            entry = self.key_entry(step.eid, m, step.round)
            for who, owner, how in step.naming:
                if owner != m or who not in ("*", recipient) or m == recipient:
                    continue
                if how == "missing":
                    entry = None
                elif how == "bare":
                    entry = [step.round]
                else:
                    kind, _, k = how.partition(":")
                    eid = step.eid if kind != "foreign" else next(e for e in self.epochs if e != step.eid)
                    stale = self.key_entry(eid, m, int(k))
                    pk = stale[1] if len(stale) == 3 else self.epochs[eid].s_pks[m]
                    sig = stale[2] if len(stale) == 3 else ""
                    entry = [step.round, pk, sig] if kind == "relabel" else stale
            if entry is not None:
                named[m] = entry
        return named

    def _train(self, step: Train) -> None:
        key = (step.eid, step.round)
        self.memory.round_sets.setdefault(key, tuple(step.round_set))
        code = ff.FieldCode(bits=BITS, clip=CLIP, max_weight=MAX_WEIGHT, clusters=len(step.round_set))
        for c in step.uploaders:
            self.key_entry(step.eid, c, step.round)  # its own key of the round, asked for if the server lacks it
            held = self.memory.sealed.get((step.eid, c), {})
            config = {"federation-id": FED, "secagg-epoch": step.eid, "server-round": step.round,
                      "secagg-round-set": list(step.round_set), "secagg-bits": BITS, "secagg-clip": CLIP,
                      "secagg-max-weight": MAX_WEIGHT, "secagg-keys": json.dumps(self._named(step, c), sort_keys=True),
                      "secagg-key-from": list(held), "secagg-key-tokens": list(held.values())}
            values = self.rng.uniform(-CLIP, CLIP, COORDS)
            weight = int(self.rng.integers(1, MAX_WEIGHT))
            what = f"train {step.eid}/r{step.round} -> {c}"
            try:
                stage = self.stages[c]
                plan = stage.prepare(config)
                masked, head = unpack_upload(stage.mask(plan, values=values, weight=weight))
            except SecAggRefusal as err:
                self.memory.outcomes.append(f"{what}: refused: {err}")
                continue
            except Exception as err:
                self.memory.outcomes.append(f"{what}: ERROR {type(err).__name__}: {err}")
                continue
            self.memory.outcomes.append(f"{what}: ok")
            self.memory.uploads.setdefault(key, {})[c] = UploadRec(c, step.eid, step.round, tuple(step.round_set),
                                                                   masked, head, code, values, weight)
            if head.get("next-key"):
                take_key(self.memory, step.eid, c, head["next-key"])

    def _round_set(self, eid: str, rnd: int, holder: str) -> tuple[str, ...]:
        up = self.memory.uploads.get((eid, rnd), {}).get(holder)
        return up.round_set if up else self.memory.round_sets.get((eid, rnd), tuple(self.setting.ids))

    def _forged(self, colluder: str, eid: str, rnd: int, round_set: tuple[str, ...], survivors: tuple[str, ...]) -> str:
        return self.stages[colluder].identity.sign("view", *evidence.view_fields(
            federation=FED, epoch=eid, setup=self.epochs[eid].setup, server_round=rnd, round_set=list(round_set),
            survivors=list(survivors)))

    def _sign(self, step: Sign) -> tuple[str, str, dict[str, Any]] | None:
        last = None
        for signer in step.signers:
            rs = self._round_set(step.eid, step.round, signer)
            survivors = tuple(sorted(step.survivors, key=int))
            got = self.memory.sigs.setdefault((step.eid, step.round, rs, survivors), {})
            if signer in self.setting.colluders:
                got[signer] = self._forged(signer, step.eid, step.round, rs, survivors)
                continue
            request = {"stage": "view", "federation-id": FED, "epoch": step.eid, "round": step.round,
                       "survivors": list(survivors), "dropped": sorted(set(rs) - set(survivors), key=int)}
            if (reply := self._send("view", signer, request)) is not None:
                got[signer] = reply["signature"]
            last = ("view", signer, request)
        return last

    def unmask_request(self, step: Unmask) -> dict[str, Any]:
        rs = self._round_set(step.eid, step.round, step.holder)
        survivors = tuple(sorted(step.survivors, key=int))
        ups = self.memory.uploads.get((step.eid, step.round), {})
        sigs = dict(self.memory.sigs.get((step.eid, step.round, rs, survivors), {}))
        sigs.update({c: self._forged(c, step.eid, step.round, rs, survivors)
                     for c in self.setting.colluders if c in survivors})
        wanted = survivors if step.forward == "all" else () if step.forward == "none" else step.forward
        senders = [s for s in wanted if s in ups and step.holder in ups[s].head["tokens"]]
        return {"stage": "unmask", "federation-id": FED, "epoch": step.eid, "round": step.round,
                "survivors": list(survivors), "dropped": sorted(set(rs) - set(survivors), key=int),
                "receipts": json.dumps({c: [digest(u.head, u.masked), u.head["receipt"], u.head["keys"]]
                                        for c, u in ups.items()}, sort_keys=True),
                "signatures": json.dumps(sigs, sort_keys=True), "from": senders,
                "tokens": [ups[s].head["tokens"][step.holder] for s in senders]}

    def _unmask(self, step: Unmask) -> tuple[str, str, dict[str, Any]]:
        request = self.unmask_request(step)
        if (reply := self._send("unmask", step.holder, request, riding=step.riding)) is not None:
            self.memory.reveals.append(("unmask", step.eid, step.round, step.holder, reply))
        return ("unmask", step.holder, request)

    def _recover(self, step: Recover) -> tuple[str, str, dict[str, Any]]:
        request = {"stage": "recover", "federation-id": FED, "epoch": step.eid, "round": step.round,
                   "clusters": list(step.clusters)}
        if (reply := self._send("recover", step.holder, request)) is not None:
            self.memory.reveals.append(("recover", step.eid, step.round, step.holder, reply))
        return ("recover", step.holder, request)

    def _replay(self, step: Replay) -> tuple[str, str, dict[str, Any]] | None:
        earlier = self.memory.requests[step.step] if step.step < len(self.memory.requests) else None
        if earlier is None:
            self.memory.outcomes.append(f"replay of step {step.step}: nothing to replay")
            return None
        kind, holder, request = earlier
        request = dict(request)
        if step.round is not None:
            request["round"] = step.round
        if step.eid is not None:
            request["epoch"] = step.eid
        eid, rnd = request["epoch"], request["round"]
        if (reply := self._send(f"replayed {kind}", holder, request)) is None:
            return (kind, holder, request)
        if kind in ("unmask", "recover"):
            self.memory.reveals.append((kind, eid, rnd, holder, reply))
        elif kind == "next-key":
            take_key(self.memory, eid, holder, reply)
        return (kind, holder, request)


# -- what the server knows, from the real bytes -------------------------------------------------------------------
_COMBINED: dict[frozenset[tuple[str, bytes]], bytes | None] = {}
_SECRETS: dict[tuple[bytes, str], bytes] = {}
_DERIVED: dict[tuple[bytes, str, str, int, tuple[int, int]], tuple[str, bytes]] = {}


CACHE_LIMIT = 200_000  # memo entries kept (a run with keys made as uploads go adds new ones every schedule)


def _trim_caches() -> None:
    for memo in (_COMBINED, _SECRETS, _DERIVED):
        if len(memo) > CACHE_LIMIT:
            memo.clear()


def _rebuilt(pieces: dict[str, bytes], *, threshold: int, check) -> bytes | None:
    """The secret `pieces` rebuild (rebuild.rebuild, checked), or None; memoised on the very shares (Flower's Shamir
    combination takes ~0.2 s for a private key on a busy core, and a tree of schedules asks for the same ones)."""
    memo = frozenset(pieces.items())
    if memo not in _COMBINED:
        try:
            _COMBINED[memo] = rebuild(pieces, threshold=threshold, check=check)[0]
        except ShareError:
            _COMBINED[memo] = None
    return _COMBINED[memo]


def _pair_candidates(sk: bytes, pk: str, eid: str, rnd: int, seqs: tuple[int, int]) -> tuple[str, bytes]:
    memo = (sk, pk, eid, rnd, seqs)
    if memo not in _DERIVED:
        if (sk, pk) not in _SECRETS:
            _SECRETS[(sk, pk)] = shares.pair_secret(sk, pk.encode())
        key = round_key(_SECRETS[(sk, pk)], epoch=eid, server_round=rnd, seqs=seqs)
        _DERIVED[memo] = (commitment(key), key)
    return _DERIVED[memo]


@dataclass
class Recovery:
    """A combination the closure says is determined, computed from the real uploads and compared with the truth."""

    what: str
    error_steps: float  # |computed - true| in quantisation steps, worst coordinate
    tolerance: float  # one step per term
    weight_ok: bool

    @property
    def real(self) -> bool:
        return self.weight_ok and self.error_steps <= self.tolerance


@dataclass
class Verdict:
    report: Report
    recoveries: list[Recovery]
    seeds: int  # self seeds rebuilt
    keys: list[str]  # mask keys rebuilt ("epoch:owner/round")
    pair_keys: int  # pair keys known (revealed or derived)
    derived: int  # of the upload's pair commitments, those derived from a known private key
    anomalies: list[str]  # shares that did not rebuild their secret, reveals that match nothing

    @property
    def leaks(self) -> bool:
        return bool(self.report.violations)

    @property
    def real(self) -> list[Recovery]:
        return [r for r in self.recoveries if r.real]


def _index(eid: str, rnd: int) -> int:
    """A closure round number for (epoch, round): e1's round 2 is 102, e2's is 202."""
    return 100 * int(eid[1:]) + rnd


def analyse(run: Run, *, thorough: bool = True) -> Verdict:
    """The server's knowledge after `run`, judged by the closure; its findings computed from the real uploads.
    `thorough=False` (the fast search): a self seed with t or more shares counts as known without being rebuilt
    (a superset of the truth, so no finding is missed); only a run with a finding is then rebuilt for real. Mask
    keys are always rebuilt (their pair keys are derived from the real private halves)."""
    _trim_caches()
    setting, memory, t = run.setting, run.memory, run.setting.t
    uploads = {(eid, rnd, c): up for (eid, rnd), ups in memory.uploads.items() for c, up in ups.items()}
    anomalies: list[str] = []

    # the pools of shares: (epoch, round, owner) -> holder -> self-seed share; (epoch, "owner/k") -> holder -> key share
    seed_pool: dict[tuple[str, int, str], dict[str, bytes]] = {}
    key_pool: dict[tuple[str, str], dict[str, bytes]] = {}
    revealed_pairs: list[bytes] = []
    for kind, eid, rnd, holder, reply in memory.reveals:
        if kind == "unmask":
            for owner, piece in zip(reply["self-from"], reply["self-shares"]):
                seed_pool.setdefault((eid, rnd, owner), {})[holder] = base64.b64decode(piece)
            revealed_pairs += [base64.b64decode(k) for k in reply["pair-keys"]]
        else:
            for name, piece in zip(reply["key-ids"], reply["key-shares"]):
                key_pool.setdefault((eid, name), {})[holder] = base64.b64decode(piece)
    known_sks: dict[tuple[str, str], bytes] = {}  # (epoch, "owner/k") -> private key PEM
    for h in setting.colluders:  # the server reads a colluder's state and opens what is sealed to it
        state = run.stages[h].state_dict()[FED]
        for eid, e in state["epochs"].items():
            if "setup" not in e:
                continue
            for name, piece in e.get("key_shares", {}).items():
                key_pool.setdefault((eid, name), {})[h] = base64.b64decode(piece)
            for k, own in e.get("mask_keys", {}).items():
                known_sks[(eid, f"{h}/{k}")] = own["sk"].encode()
            known_sks[(eid, f"{h}/{e['first_round']}")] = e["s_sk"].encode()
            for name, token in memory.sealed.get((eid, h), {}).items():
                owner, _, k = name.partition("/")
                try:
                    piece = shares.unseal(shares.fernet_key(e["c_sk"].encode(), run.epochs[eid].c_pks[owner].encode()),
                                          token.encode(), expect={"kind": "key", "from": owner, "to": h, "epoch": eid,
                                                                  "seq": int(k)})
                except ShareError as err:
                    anomalies.append(f"colluder {h} cannot open the share of {eid}:{name} sealed to it: {err}")
                    continue
                key_pool.setdefault((eid, name), {})[h] = piece
            for (ueid, rnd, owner), up in uploads.items():
                if ueid != eid:
                    continue
                if owner == h:
                    own = state["rounds"].get(f"{eid}/{rnd}", {}).get("own_share")
                    if own:
                        seed_pool.setdefault((eid, rnd, h), {})[h] = base64.b64decode(own)
                elif h in up.head["tokens"]:
                    try:
                        piece = shares.unseal(
                            shares.fernet_key(e["c_sk"].encode(), run.epochs[eid].c_pks[owner].encode()),
                            up.head["tokens"][h].encode(),
                            expect={"kind": "self", "from": owner, "to": h, "epoch": eid, "round": rnd,
                                    "key": up.head["keys"][owner]})
                    except ShareError as err:
                        anomalies.append(f"colluder {h} cannot open {owner}'s self share of {eid}/r{rnd}: {err}")
                        continue
                    seed_pool.setdefault((eid, rnd, owner), {})[h] = piece

    def public(eid: str, name: str) -> str | None:
        owner, _, k = name.partition("/")
        if int(k) == run.epochs[eid].first:
            return run.epochs[eid].s_pks[owner]
        pub = memory.pubs.get((eid, owner, int(k)))
        return pub[1] if pub else None

    rebuilt_keys = []
    for (eid, name), pieces in key_pool.items():
        pk = public(eid, name)
        if len(pieces) < t or pk is None or (eid, name) in known_sks:
            continue
        pem = _rebuilt(pieces, threshold=t, check=lambda k, p=pk: shares.matches_public(k, p.encode()))
        if pem is None:
            anomalies.append(f"{len(pieces)} shares of mask key {eid}:{name} do not rebuild it")
        else:
            known_sks[(eid, name)] = pem
            rebuilt_keys.append(f"{eid}:{name}")

    # pair keys: revealed, or derived from a known private key and any public key seen, any epoch, round, numbers
    targets: dict[str, list[tuple[str, int, str, str]]] = {}
    for (eid, rnd, c), up in uploads.items():
        for d, commit in up.head["commit"]["pairs"].items():
            targets.setdefault(commit, []).append((eid, rnd, c, d))
    pair_keys: dict[str, bytes] = {}
    derived: set[str] = set()
    for key in revealed_pairs:
        if commitment(key) in targets:
            pair_keys[commitment(key)] = key
        else:
            anomalies.append("a revealed pair key matches no upload's commitment")
    pks = {pk for info in run.epochs.values() for pk in info.s_pks.values()} | {p[1] for p in memory.pubs.values()}
    rounds = {eid: sorted({rnd for (e, rnd) in memory.uploads if e == eid}) for eid in run.epochs}
    numbers = {eid: sorted({int(k) for (e, _, _), up in uploads.items() if e == eid for k in up.head["keys"].values()}
                           | set(rounds[eid])) for eid in run.epochs}
    for sk in set(known_sks.values()):
        for pk in pks:
            for eid in run.epochs:
                for rnd in rounds[eid]:
                    for seqs in itertools.product(numbers[eid], repeat=2):
                        commit, key = _pair_candidates(sk, pk, eid, rnd, seqs)
                        if commit in targets:
                            pair_keys[commit] = key
                            derived.add(commit)

    closure_uploads = [Upload(_index(eid, rnd), c, "s:" + up.head["commit"]["self"],
                              {d: (pair_sign(c, d), "p:" + p) for d, p in up.head["commit"]["pairs"].items()})
                       for (eid, rnd, c), up in uploads.items()]
    pairs_known = {"p:" + p for p in pair_keys}
    enough = {k for k, pieces in seed_pool.items() if k in uploads and len(pieces) >= t}
    if not thorough:  # every seed with t shares taken as known: more than the truth, never less
        report = closure(closure_uploads, known=pairs_known | {"s:" + uploads[k].head["commit"]["self"] for k in enough},
                         threshold=t, colluders=setting.colluders)
        if not report.violations:
            return Verdict(report, [], len(enough), sorted(rebuilt_keys), len(pair_keys), len(derived), anomalies)
    seeds: dict[tuple[str, int, str], bytes] = {}
    for key in sorted(enough):
        commit = uploads[key].head["commit"]["self"]
        secret = _rebuilt(seed_pool[key], threshold=t, check=lambda s, c=commit: commitment(s) == c)
        if secret is None:
            anomalies.append(f"{len(seed_pool[key])} shares of {key[2]}'s self seed of {key[0]}/r{key[1]} do not "
                             "rebuild it")
        else:
            seeds[key] = secret
    known = pairs_known | {"s:" + uploads[k].head["commit"]["self"] for k in seeds}
    report = closure(closure_uploads, known=known, threshold=t, colluders=setting.colluders)

    by_index = {(c, _index(eid, rnd)): up for (eid, rnd, c), up in uploads.items()}
    recoveries = []
    for finding in report.violations:
        for combination in finding.combinations:
            terms = _terms(combination)
            if terms is not None:
                recoveries.append(_compute(combination, terms, by_index, seeds, pair_keys))
    return Verdict(report, recoveries, len(seeds), sorted(rebuilt_keys), len(pair_keys), len(derived), anomalies)


_TERM = re.compile(r"([+-]?) ?(?:(\d+)(?:/(\d+))?\*)?x\[(\w+)@r(\d+)\]")


def _terms(combination: str) -> list[tuple[int, str, int]] | None:
    """[(coefficient, cluster, closure round)] of "x[a@r101] - x[b@r102]"; None if a coefficient is not an integer."""
    out = []
    for sign, a, b, c, r in _TERM.findall(combination):
        if b and int(b) != 1:
            return None
        out.append(((-1 if sign == "-" else 1) * int(a or 1), c, int(r)))
    return out


def _compute(what: str, terms: list[tuple[int, str, int]], by_index: dict[tuple[str, int], UploadRec],
             seeds: dict[tuple[str, int, str], bytes], pair_keys: dict[str, bytes]) -> Recovery:
    """Σ coefficient · (upload − its known masks), in the ring, against Σ coefficient · w·x / step (the truth)."""
    mod = 1 << BITS
    total = np.zeros(COORDS + 1, dtype=object)
    truth = np.zeros(COORDS, dtype=float)
    weight = 0
    for coef, c, idx in terms:
        up = by_index[(c, idx)]
        code = up.code
        residual = up.vector.astype(object)
        seed = seeds.get((up.eid, up.round, c))
        if seed is not None:
            residual = residual - expand(seed, count=COORDS + 1, code=code).astype(object)
        for d, commit in up.head["commit"]["pairs"].items():
            if commit in pair_keys:
                mask = expand(pair_keys[commit], count=COORDS + 1, code=code).astype(object)
                residual = residual - mask if pair_sign(c, d) > 0 else residual + mask
        total = total + coef * residual
        truth += coef * up.weight * np.clip(up.values, -CLIP, CLIP) / code.step
        weight += coef * up.weight
    signed = np.array([int(v) % mod - (mod if int(v) % mod >= mod // 2 else 0) for v in total], dtype=float)
    error = float(np.abs(signed[:-1] - truth).max())
    return Recovery(what, error, float(sum(abs(c) for c, _, _ in terms)), int(signed[-1]) == weight)


# -- the search ----------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """A search's count: schedules, messages, refusals by reason, errors, and every finding with its schedule."""

    setting: Setting
    schedules: int = 0
    messages: int = 0
    accepted: int = 0
    refusals: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)  # schedule, violations, real recoveries
    leaking: int = 0  # schedules after which the server determines something below the threshold
    real: int = 0  # of those, schedules with at least one real recovery (computed from the uploads)
    seeds_rebuilt: int = 0
    keys_rebuilt: int = 0
    pairs_derived: int = 0
    seconds: float = 0.0

    def add(self, schedule: Schedule, run: Run, verdict: Verdict) -> None:
        self.schedules += 1
        for line in run.memory.outcomes:
            self.messages += 1
            if line.endswith(": ok"):
                self.accepted += 1
            elif ": refused: " in line:
                self.refusals[_reason(line.split(": refused: ", 1)[1])] += 1
            elif "ERROR" in line and len(self.errors) < 20:
                self.errors.append(f"{schedule.label}: {line}")
        self.anomalies += [f"{schedule.label}: {a}" for a in verdict.anomalies][: max(0, 20 - len(self.anomalies))]
        self.seeds_rebuilt += verdict.seeds
        self.keys_rebuilt += len(verdict.keys)
        self.pairs_derived += verdict.derived
        if verdict.leaks:
            self.leaking += 1
            self.real += bool(verdict.real)
            if len(self.findings) < 10:
                self.findings.append({
                    "schedule": schedule.to_json(), "report": str(verdict.report),
                    "keys_rebuilt": verdict.keys,
                    "recoveries": [asdict(r) | {"real": r.real} for r in verdict.recoveries]})

    def to_json(self) -> dict[str, Any]:
        return {"setting": asdict(self.setting) | {"label": self.setting.label}, "schedules": self.schedules,
                "leaking_schedules": self.leaking, "real_recoveries": self.real, "messages": self.messages,
                "accepted": self.accepted, "refusals": dict(self.refusals.most_common()), "errors": self.errors,
                "anomalies": self.anomalies, "seeds_rebuilt": self.seeds_rebuilt, "keys_rebuilt": self.keys_rebuilt,
                "pairs_derived": self.pairs_derived,
                "seconds": round(self.seconds, 1), "findings": self.findings}


def _reason(text: str) -> str:
    """A refusal's reason with its particulars (ids, rounds, keys) blanked, to count reasons."""
    text = re.sub(r"secure aggregation \(unmask\): ", "", text)
    text = re.sub(r"\[[^\]]*\]", "[..]", text)
    text = re.sub(r"'[^']*'", "'..'", text)
    return re.sub(r"\b\d+(/\d+)?\b", "N", text)[:110]


def judge(tally: Tally, schedule: Schedule, run: Run, *, thorough: bool = True) -> Verdict:
    verdict = analyse(run, thorough=thorough)
    tally.add(schedule, run, verdict)
    return verdict


def play(setting: Setting, schedule: Schedule, *, seed: int = 0) -> tuple[Run, Verdict]:
    run = Run(setting, seed=seed).play(schedule.steps)
    return run, analyse(run)


def search_random(setting: Setting, *, schedules: int, seed: int = 0, tally: Tally | None = None,
                  thorough: bool = True) -> Tally:
    tally = tally or Tally(setting)
    started = time.perf_counter()
    rng = np.random.default_rng([seed, setting.n, setting.t, len(setting.colluders), int(setting.rotate)])
    for i in range(schedules):
        schedule = random_schedule(setting, rng, label=f"random {seed}/{i}")
        run = Run(setting, seed=i).play(schedule.steps)
        judge(tally, schedule, run, thorough=thorough)
    tally.seconds += time.perf_counter() - started
    return tally


# -- random schedules -----------------------------------------------------------------------------------------------
def _pick(rng: np.random.Generator, items: list[Any], k: int) -> list[Any]:
    return [items[i] for i in sorted(rng.choice(len(items), size=min(k, len(items)), replace=False))]


def _ordered(ids: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(ids), key=int))


def random_schedule(setting: Setting, rng: np.random.Generator, *, label: str) -> Schedule:
    """A seeded random schedule: rounds of one epoch (sometimes a second epoch's rounds after them) with random round
    sets (now and then a different one for some of the round's clusters), absences, key naming, per-holder views,
    signers, forwarding, unmask timing (now, riding on the next train message, deferred), recovers (of the dropped,
    and of anyone, now or at the end), next-key requests for any round and replays with another round or epoch."""
    ids, t = setting.ids, setting.t
    plan = [("e1", r) for r in range(1, ROUNDS + 1)]
    if setting.epochs > 1 and rng.random() < 0.5:
        plan += [("e2", r) for r in (2, 3)]
    steps: list[Step] = []
    deferred: list[Step] = []
    riding: list[Step] = []
    played: list[tuple[str, int]] = []
    for eid, rnd in plan:
        if rng.random() < 0.15:
            steps.append(NextKey(eid, str(rng.choice(ids)), int(rnd + rng.integers(0, 6))))
        size = len(ids) if rng.random() < 0.5 else int(rng.integers(t, len(ids) + 1))
        round_set = _ordered(_pick(rng, ids, size))
        absent = _pick(rng, list(round_set), int(rng.choice([0, 0, 1, 1, 2]))) if len(round_set) > t else []
        uploaders = _ordered(set(round_set) - set(absent))
        sets = dict.fromkeys(uploaders, round_set)  # each uploader's round set
        if rng.random() < 0.1 and len(uploaders) > 1:  # some are told another round set (without one other member)
            group = _pick(rng, list(uploaders), int(rng.integers(1, len(uploaders))))
            other = _ordered(set(round_set) - {str(rng.choice([c for c in round_set if c not in group]))})
            sets.update(dict.fromkeys(group, other))
        naming: list[tuple[str, str, str]] = []
        if rng.random() < 0.35:
            owner = str(rng.choice(round_set))
            earlier = [r for e, r in played if e == eid] or [EPOCHS[eid]]
            hows = [f"stale:{rng.choice(earlier)}", f"relabel:{rng.choice(earlier)}", f"stale:{rnd + 1}", "missing",
                    "bare"] + ([f"foreign:{rnd}"] if setting.epochs > 1 else [])
            how = str(rng.choice(hows))
            who = "*" if rng.random() < 0.5 else str(rng.choice(uploaders)) if uploaders else "*"
            naming.append((who, owner, how))
        steps += riding
        riding = []
        for told in sorted(set(sets.values())):
            steps.append(Train(eid, rnd, told, _ordered(c for c, v in sets.items() if v == told), tuple(naming)))
        if not uploaders:
            steps.append(Train(eid, rnd, round_set, (), tuple(naming)))
        played.append((eid, rnd))
        if not uploaders:
            continue
        # views: honest, a claimed dropout, a split between two views, or one per holder; within its round set
        pattern = rng.choice(["honest", "claim", "split", "each"], p=[0.3, 0.3, 0.25, 0.15])
        view: dict[str, tuple[str, ...]] = {}
        claimed = _ordered(_pick(rng, list(uploaders), 1 if rng.random() < 0.8 else 2))
        for h in uploaders:
            alive = _ordered(set(uploaders) & set(sets[h]))
            if pattern == "honest":
                view[h] = alive
            elif pattern == "claim":
                view[h] = _ordered(set(alive) - set(claimed)) if h not in claimed else alive
            elif pattern == "split":
                view[h] = _ordered(set(alive) - set(claimed)) if rng.random() < 0.5 and h not in claimed else alive
            else:  # any survivors within its round set, even one that never uploaded
                others = [c for c in sets[h] if c != h]
                view[h] = _ordered({h, *_pick(rng, others, int(rng.integers(min(t - 1, len(others)), len(others) + 1)))})
        for survivors in sorted(set(view.values())):
            holders = [h for h, v in view.items() if v == survivors]
            if all(survivors == sets[h] for h in holders):
                continue  # the full view needs no signatures
            signers = holders if rng.random() < 0.8 else _pick(rng, list(survivors), int(rng.integers(1, len(survivors) + 1)))
            steps.append(Sign(eid, rnd, survivors, _ordered(signers)))
        target = str(rng.choice(uploaders))
        for h in uploaders:
            if rng.random() < 0.08:
                continue
            fwd_kind = rng.choice(["all", "none", "target", "some"], p=[0.55, 0.1, 0.2, 0.15])
            forward: str | tuple[str, ...] = (
                str(fwd_kind) if fwd_kind in ("all", "none") else
                ((target,) if h != target else ()) if fwd_kind == "target" else
                _ordered(_pick(rng, list(view[h]), int(rng.integers(0, len(view[h]) + 1)))))
            when = rng.choice(["now", "riding", "end"], p=[0.6, 0.25, 0.15])
            unmask = Unmask(eid, rnd, h, view[h], forward, riding=when == "riding")
            (steps if when == "now" else riding if when == "riding" else deferred).append(unmask)
        dropped = sorted({c for h, v in view.items() for c in sets[h] if c not in v} | set(absent), key=int)
        for gone in dropped:
            holders = [h for h in ids if h != gone]
            if rng.random() < 0.3:
                holders = _pick(rng, holders, int(rng.integers(1, len(holders) + 1)))
            later = rng.random() < 0.5
            for h in holders:
                (deferred if later else steps).append(Recover(eid, rnd, h, (gone,)))
        if rng.random() < 0.1:  # anyone, any round played so far
            e, r = played[int(rng.integers(0, len(played)))]
            deferred.append(Recover(e, r, str(rng.choice(ids)), (str(rng.choice(ids)),)))
        if rng.random() < 0.12 and steps:
            index = int(rng.integers(0, len(steps)))
            if isinstance(steps[index], Unmask | Recover | Sign | NextKey):
                e, r = played[int(rng.integers(0, len(played)))]
                other = str(rng.choice(list(EPOCHS)[: setting.epochs]))
                deferred.append(Replay(index, round=r, eid=other if rng.random() < 0.3 else None))
    # a Replay names a step by its place in the schedule, which the deferred steps do not change: they come last
    tail = [s for s in deferred if not isinstance(s, Replay)]
    replays = [s for s in deferred if isinstance(s, Replay)]
    return Schedule(label, (*steps, *riding, *tail, *replays))


# -- the structured sweep ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """One round of the sweep. kind: "honest" (everyone in the round set uploads, full view), "absent" (the dropped
    cluster gets no train message; the rest sign the view without it), "claim" (it uploads, the server says it
    dropped), "split" (it and the target are shown the full view, the rest a view without it). `drop`: "a" (this
    round's helper: A[0] in round 1, A[i-1] in round 1+i) or "j" (the target); `set`: "all" or "jA" ({j} ∪ A);
    `forward`: "all" or "j-only" (to each holder but j only j's sealed self share, to j nothing); `naming` (absent):
    the others are named the dropped cluster's right key, or its key of the epoch's first round as it was published
    ("stale") or relabelled as this round's ("relabel"); `recover`: the dropped cluster's key asked of everyone else
    "now" or at the "end" of the run."""

    kind: str
    set: str = "all"
    forward: str = "all"
    drop: str = "a"
    naming: str = "right"
    recover: str = "end"

    def __str__(self) -> str:
        if self.kind == "honest":
            return f"honest({self.set},{self.forward})"
        extra = f",{self.naming}" if self.kind == "absent" else ""
        return f"{self.kind}({self.drop}{extra},{self.set},{self.forward},rec:{self.recover})"


def moves(*, sets: Iterable[str] = ("all", "jA"), kinds: Iterable[str] = ("honest", "absent", "claim", "split"),
          forwards: Iterable[str] = ("all", "j-only"), drops: Iterable[str] = ("a", "j"),
          namings: Iterable[str] = ("right", "stale", "relabel"), recovers: Iterable[str] = ("now", "end")) -> list[Move]:
    """The product of the dimensions, without the duplicates (naming matters only for an absent cluster, drop and
    recover timing only with a dropout)."""
    out: list[Move] = []
    for kind, s, fwd in itertools.product(kinds, sets, forwards):
        if kind == "honest":
            out.append(Move("honest", s, fwd))
            continue
        for drop, rec in itertools.product(drops, recovers):
            for naming in namings if kind == "absent" else ("right",):
                out.append(Move(kind, s, fwd, drop, naming, rec))
    return out


def target_helpers(setting: Setting, eid: str) -> list[str]:
    """A: the t - 1 first neighbours of the target j (cluster "0") in the epoch's graph."""
    nbrs = graph.neighbours(setting.ids, num_shares=setting.num_shares, seed=eid)["0"]
    return sorted(nbrs, key=int)[: setting.t - 1]


def block(setting: Setting, move: Move, eid: str, rnd: int) -> tuple[list[Step], list[Step]]:
    """(steps now, steps deferred to the end of the run) of one move in round `rnd`."""
    ids = setting.ids
    j, helpers = ids[0], target_helpers(setting, eid)
    first = EPOCHS[eid]
    a = helpers[(rnd - first - 1) % len(helpers)] if rnd > first else helpers[0]
    round_set = tuple(ids) if move.set == "all" else _ordered((j, *helpers))
    gone = None if move.kind == "honest" else a if move.drop == "a" else j
    uploaders = tuple(c for c in round_set if not (move.kind == "absent" and c == gone))
    naming = ()
    if move.kind == "absent" and move.naming != "right":
        naming = (("*", gone, "missing" if move.naming == "missing" else f"{move.naming}:{first}"),)
    now: list[Step] = [Train(eid, rnd, round_set, uploaders, naming)]

    def forward(h: str) -> str | tuple[str, ...]:
        return "all" if move.forward == "all" else (j,) if h != j else ()

    if move.kind == "honest":
        now += [Unmask(eid, rnd, h, round_set, forward(h)) for h in uploaders]
        return now, []
    without = tuple(c for c in round_set if c != gone)
    if move.kind == "split":
        told_full = {gone, j}
        rest = tuple(c for c in without if c not in told_full)
        if rest:
            now.append(Sign(eid, rnd, without, rest))
        now += [Unmask(eid, rnd, h, round_set if h in told_full else without, forward(h)) for h in uploaders]
    else:
        now.append(Sign(eid, rnd, without, without))
        now += [Unmask(eid, rnd, h, without, forward(h)) for h in without]
    recover = [Recover(eid, rnd, h, (gone,)) for h in ids if h != gone]
    return (now + recover, []) if move.recover == "now" else (now, recover)


def sweep(setting: Setting, menus: list[list[Move]], *, tally: Tally | None = None, limit: int | None = None,
          thorough: bool = True) -> Tally:
    """Every schedule of len(menus) rounds, one move of each round's menu, played as a tree from the cached setup: the
    state after a prefix is saved and restored for each way to go on. `limit`: stop after that many schedules."""
    tally = tally or Tally(setting)
    started = time.perf_counter()
    run = Run(setting)
    count = [0]

    def descend(depth: int, chosen: list[Move], deferred: list[Step]) -> None:
        if limit is not None and count[0] >= limit:
            return
        if depth == len(menus):
            saved = run.save()
            run.play(deferred)
            label = "sweep " + " ; ".join(str(m) for m in chosen)
            judge(tally, Schedule(label, tuple(run.steps)), run, thorough=thorough)
            count[0] += 1
            run.restore(saved)
            return
        saved = run.save()
        for move in menus[depth]:
            now, later = block(setting, move, "e1", depth + 1)
            run.play(now)
            descend(depth + 1, [*chosen, move], deferred + later)
            run.restore(saved)

    descend(0, [], [])
    tally.seconds += time.perf_counter() - started
    return tally


def sweep_size(menus: list[list[Move]]) -> int:
    return int(np.prod([len(m) for m in menus]))


# -- the menus and the fixed schedules --------------------------------------------------------------------------------
SMALL_MENU = [Move("honest"), Move("honest", "jA", "j-only"), Move("absent", naming="right", recover="end"),
              Move("absent", naming="stale", recover="end"), Move("claim", recover="now"),
              Move("claim", drop="j", recover="end")]
"""Six moves a round: the issue-30 rounds (and its stale-key variant), the control's finding, honest rounds."""
MEDIUM_MENU = [*SMALL_MENU, Move("honest", "all", "j-only"), Move("absent", naming="relabel", recover="now"),
               Move("absent", naming="missing", recover="end"), Move("absent", drop="j", recover="now"),
               Move("absent", "all", "j-only", recover="now"), Move("claim", "jA", recover="end"),
               Move("split", recover="end"), Move("split", drop="j", recover="now")]
"""Fourteen: every round set, view pattern (honest, absent, claimed, split), forwarding, naming (right, stale,
relabelled, missing) and recover timing at least once."""


def issue30_moves(setting: Setting, *, stale: str | None = None, rounds: int = ROUNDS) -> list[Move]:
    """Issue 30 as moves. Round 1: round set {j} ∪ A, everyone uploads, full view; each a ∈ A is forwarded only j's
    sealed self share, j nothing. Round 1 + i (i = 1 .. t - 1): all members, a = A[i-1] gets no train message, the
    rest sign the view without it and unmask; at the end everyone but a is asked for a's key of round 1 + i.
    `stale`: the others are named a's key of round 1 ("stale": as published, numbered 1; "relabel": named as this
    round's). Later rounds, up to `rounds`, are honest."""
    out = [Move("honest", "jA", "j-only")]
    out += [Move("absent", "all", "all", "a", stale or "right", "end") for _ in range(setting.t - 1)]
    return out + [Move("honest") for _ in range(rounds - len(out))]


def schedule_of(setting: Setting, chosen: list[Move], *, label: str = "") -> Schedule:
    """The schedule a sweep plays for these moves (rounds 1, 2, ... of epoch e1; deferred steps at the end)."""
    steps: list[Step] = []
    deferred: list[Step] = []
    for rnd, move in enumerate(chosen, start=1):
        now, later = block(setting, move, "e1", rnd)
        steps += now
        deferred += later
    return Schedule(label or "sweep " + " ; ".join(map(str, chosen)), (*steps, *deferred))


def issue30_schedule(setting: Setting, *, stale: str | None = None, rounds: int = ROUNDS) -> Schedule:
    name = {None: "issue 30", "stale": "issue 30, stale key", "relabel": "issue 30, stale key relabelled"}[stale]
    chosen = issue30_moves(setting, stale=stale, rounds=rounds)
    return schedule_of(setting, chosen, label=f"{name}: " + " ; ".join(map(str, chosen)))


def control_moves() -> list[Move]:
    """The control's own finding, in two rounds: round 1, the server says a dropped (it uploaded) and everyone else
    gives a's key at once; round 2, a masks with that same key (the control's one key an epoch) and the round is
    settled honestly: every mask of a's round-2 upload is known."""
    return [Move("claim", recover="now"), Move("honest")]


def control_schedule(setting: Setting) -> Schedule:
    return schedule_of(setting, control_moves(), label="control: " + " ; ".join(map(str, control_moves())))


def refusals(run: Run) -> list[str]:
    return [line for line in run.memory.outcomes if ": refused: " in line or "ERROR" in line]


def main() -> None:
    for rotate in (False, True):
        for n, t in ((3, 2), (4, 3), (5, 3)):
            setting = Setting(n, t, rotate=rotate)
            for schedule in (issue30_schedule(setting), issue30_schedule(setting, stale="stale"),
                             issue30_schedule(setting, stale="relabel"), control_schedule(setting)):
                run, verdict = play(setting, schedule)
                print(f"{setting.label}: {schedule.label.split(':')[0]}: keys rebuilt {verdict.keys}; "
                      f"{len(verdict.real)} real recoveries; {verdict.report.singles or 'no single'}")
                for line in refusals(run)[:3]:
                    print("    " + line)
            tally = search_random(setting, schedules=20)
            print(f"{setting.label}: 20 random schedules, {tally.leaking} leaking, {tally.real} with a real recovery "
                  f"({tally.seconds:.1f} s)")


if __name__ == "__main__":
    main()
