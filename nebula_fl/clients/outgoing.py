"""What may leave a cluster, and `released`: the one function every frame its trainer sends passes through.

Under secure aggregation (the round is masked, or the operator's policy demands masking) the server learns the
sum of the masked updates and their total weight, and nothing computed from one cluster's data or size: a frame
then says only the keys below, each a function of the request, the operator's size-free settings or the
cluster's hardware. Free text (an error, a refusal's reason) is said as it is only when the frame is marked
`PLAIN` (the text is about the request or the operator's requirement); otherwise a fixed sentence goes out and
the text stays in the cluster's log.

Per-example DP's σ, δ, ε, q and step counts never leave under secure aggregation. With a target ε, σ is
derived from q = B/n and the default δ = 1/(10 n), so σ and δ each name n (σ = 0.5527 at n = 2,000, 0.3897
at 16,000, for one ε and batch). A σ derived from values the server knows instead would account the cluster
at a sample rate it does not sample at: understated, it spends more budget than the ledger says; at q = 1 it
adds noise for nothing. So the mechanism keeps the cluster's true σ, and the figures stay in its ledger and
report (``nebula-fl privacy-report STATE``): the server does no per-example accounting and needs none of them.
A σ the request fixed is withheld too, so what a reply says does not depend on how σ was chosen. Client-level
DP's figures are the server's own σ, q = 1 and the operator's δ (no n in any): they stay, and let the server
check its accountant against the clusters'.
"""

from __future__ import annotations

from typing import Any

from nebula_fl.clients.protocol import join, split

IN_THE_CLEAR = {
    "cluster-id": "who answers: the server addressed this cluster",
    "privacy-refused": "that the cluster refused the round",
    "privacy-refusal": "the kind of refusal: 'policy' or 'budget'",
    "privacy-reason": "a refusal's reason: the operator's requirement, or a fixed sentence (the figures stay in the log)",
    "secagg-keys-held": "protocol state: whether the key shares arrived",
    "steps": "the local steps the server asked for (a masked round refuses local-steps = \"auto\")",
    "workers": "the cluster's hardware, not its data",
    "nodes": "the cluster's hardware (machines it spans), not its data",
    "device": "the cluster's hardware, not its data",
    "precision": "the cluster's hardware choice (bf16 autocast or fp32), not its data",
    "parallel": "the cluster's hardware, not its data",
    "codec-up": "the codec the server asked for",
    "prox-mu": "the proximal weight the server asked for",
    "update-bytes": "fixed by the codec and the adapter's size",
    "privacy-mode": "the mode of the privacy figures: the request's, or the operator's policy's",
    "max-grad-norm": "the clipping norm: the request's, or the operator's",
    "max-epsilon": "the operator's budget, or the request's if lower",
    "privacy-no-budget": "that the operator set no budget (policy 'off', as `hello` says): a setting, not the data",
    "accountant": "the operator's choice",
}
# Client-level DP accounts each release at q = 1 with the server's σ and δ = 1e-5 (or the operator's): no figure
# depends on the shard. Per-example DP's do (module docstring): they stay in the cluster's own report.
IN_THE_CLEAR_CLIENT_DP = {
    "noise-multiplier": "the server's privacy-sigma (over its noise shares)",
    "sample-rate": "1: no amplification by sampling is claimed",
    "delta": "the operator's δ, else 1e-5",
    "epsilon": "the cluster's client-level releases at the server's σ",
    "epsilon-federation": "the same, in this federation",
    "dp-steps": "the cluster's client-level releases so far",
}
# A frame's own keys: metrics are filtered as above; the rest is protocol (a secure-aggregation stage's answer,
# which is random or sealed) or a `hello`'s description (its keys, with '_', are in IN_THE_CLEAR).
FRAME_KEYS = ("ok", "error", "metrics", "secagg", "reply")
PLAIN = "plain"  # internal: the frame's free text is a function of the request or the operator's policy alone
HIDDEN_ERROR = ("the cluster could not serve the round; the reason is in its log (under secure aggregation it "
                "could tell the cluster's data)")


def hidden_reason(refusal: Any) -> str:
    """A refusal's reason under secure aggregation: the gate's own names δ, the σ floor and ε, each set by n."""
    kind = refusal if refusal in ("policy", "budget") else "policy"
    return (f"refused by this cluster's privacy {kind}; the reason is in its log (under secure aggregation its "
            "figures could tell the cluster's size)")


def in_the_clear(metrics: dict[str, Any], *, mode: str) -> dict[str, Any]:
    """What a securely aggregated frame's metrics may say: no example count, no loss, no timing of its own (a
    server sees when a reply arrives, not how long the training in it took; under per-example DP with the
    default logical batch of n/8 that time grows with n), no per-example DP figure."""
    allowed = set(IN_THE_CLEAR) | (set(IN_THE_CLEAR_CLIENT_DP) if mode == "client" else set())
    return {k: v for k, v in metrics.items() if k in allowed}


def _clear_header(header: dict[str, Any], *, secure: bool) -> dict[str, Any]:
    plain = header.get(PLAIN) is True
    out = {k: v for k, v in header.items() if k != PLAIN}
    if not secure:
        return out
    out = {k: v for k, v in out.items() if k in FRAME_KEYS or k.replace("_", "-") in IN_THE_CLEAR}
    if "error" in out and not plain:
        out["error"] = HIDDEN_ERROR
    if "metrics" in out:
        metrics = out["metrics"] if isinstance(out["metrics"], dict) else {}
        mode = metrics.get("privacy-mode")  # the gate names the mode its figures are of; none: no DP figure passes
        metrics = in_the_clear(metrics, mode=mode if isinstance(mode, str) else "off")
        if "privacy-reason" in metrics and not plain:
            metrics["privacy-reason"] = hidden_reason(metrics.get("privacy-refusal"))
        out["metrics"] = metrics
    return out


def released(frame: bytes, *, secure: bool) -> bytes:
    """The frame as it may leave the cluster (`secure`: under secure aggregation's rule). The body (the update,
    masked under secure aggregation) passes untouched; a frame already released comes back as the same bytes,
    so a cached reply replays byte for byte."""
    header, body = split(frame)
    clear = _clear_header(header, secure=secure)
    return frame if clear == header else join(clear, body)
