"""`nebula-fl generate`: what federated tuning changed in a causal LM, shown as greedy completions side by side.

A run folder holds the run's whole config (``config.json``: every option, defaults included) and its final
exchanged weights: ``adapter.safetensors`` (LoRA) or, for ``task.exchange = "full"``, ``model.safetensors`` (the
whole state dict). Neither the base weights nor the tokenizer are stored: the model is rebuilt from the config
exactly as the run's server built it (the named or shipped model, or the seeded 'scratch' Llama), so the "base"
completion is the model every cluster started from (LoRA's B starts at zero: the base model itself) and the
"tuned" one is the same model with the final weights loaded.

Prompts are formatted as training formatted them (``CausalLMTask.format_prompt``: the chat template or the plain
one; raw text under ``objective = "pretrain"``) and decoded greedily until the template's turn end, EOS or the token
limit, one prompt at a time (no padding, so a completion is exactly what ``model.generate`` gives that prompt).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nebula_fl.errors import NebulaError

MAX_NEW_TOKENS = 1024
TASK = "causal-lm"


@dataclass(kw_only=True, frozen=True)
class Completion:
    """One greedy completion: its text, its token ids, and whether it ended with the end token (else the limit
    cut it)."""

    text: str
    token_ids: list[int]
    stopped: bool

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "tokens": len(self.token_ids), "stopped": self.stopped}


@dataclass(kw_only=True, frozen=True)
class Comparison:
    prompt: str
    base: Completion
    tuned: Completion

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "base": self.base.to_dict(), "tuned": self.tuned.to_dict(),
                "changed": self.base.token_ids != self.tuned.token_ids}


@dataclass(kw_only=True, frozen=True)
class GenerateRequest:
    """What to generate: checked before any model is loaded."""

    prompts: tuple[str, ...]
    max_new_tokens: int = 64
    """New tokens per completion at most; 1 to 1,024."""

    def __post_init__(self) -> None:
        if not self.prompts:
            raise NebulaError("generate needs at least one --prompt TEXT")
        for i, prompt in enumerate(self.prompts, 1):
            if not isinstance(prompt, str) or not prompt.strip():
                raise NebulaError(f"--prompt number {i} is empty; give the text the model should complete")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
            raise NebulaError(f"--max-new-tokens is {n!r}; use 1 to {MAX_NEW_TOKENS}")


@dataclass(kw_only=True)
class RunModel:
    """A completed causal-lm run's model, rebuilt from its config, with the final weights not yet loaded."""

    folder: Path
    task: Any  # CausalLMTask
    model: nn.Module
    tokenizer: Any
    weights: Path
    """adapter.safetensors or model.safetensors: the run's final exchanged weights."""
    model_name: str
    summary: dict[str, Any]

    def load_final(self) -> None:
        """Set the run's final weights: the adapter through the task (keys and shapes checked), or every tensor of
        a full-exchange run's state dict (strict: a missing or extra tensor is an error)."""
        from safetensors.numpy import load_file

        arrays = load_file(str(self.weights))
        try:
            if self.task.exchange == "full":
                state = {k: torch.from_numpy(v) for k, v in arrays.items()}
                self.model.load_state_dict(state, strict=True)
            else:
                self.task.load_exchanged(self.model, arrays)
        except (ValueError, KeyError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise NebulaError(f"'{self.weights}' does not fit the model the run's config describes ({first}); the "
                              "folder is damaged or edited, or --model points at another model") from None

    @torch.no_grad()
    def complete(self, prompt: str, *, max_new_tokens: int) -> Completion:
        """The greedy completion of `prompt`, formatted as training formatted it, ended by a stop token."""
        from transformers import GenerationConfig

        from nebula_fl.tasks.causal_lm import pad_token, until_stop

        ids = self.task.prompt_ids(self.tokenizer, prompt)  # as training did
        if not ids:
            raise NebulaError("a --prompt encodes to no tokens; give some text")
        stops = self.task.stop_tokens(self.tokenizer)  # the template's turn end, as training learned it, and EOS
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        # an explicit config: the model's own generation defaults (sampling, penalties) must not change greedy decoding
        # (transformers fills only what a config leaves unset from the model's own, so every knob is set here)
        config = GenerationConfig(do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                  min_new_tokens=0, max_new_tokens=max_new_tokens, eos_token_id=stops,
                                  pad_token_id=pad_token(self.tokenizer))
        self.model.eval()
        out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  generation_config=config)
        new, stopped = until_stop([int(t) for t in out[0, len(ids):]], stops)
        return Completion(text=self.tokenizer.decode(new, skip_special_tokens=True), token_ids=new, stopped=stopped)


def pick_device(spec: str) -> str:
    """`--device`: auto (the first visible GPU, else cpu), cpu, cuda or cuda:N (checked to exist)."""
    from nebula_fl.devices import check_visible, visible_gpus, worker_devices

    visible = visible_gpus()
    if spec == "auto":
        return "cuda:0" if visible else "cpu"
    (device,) = worker_devices(spec, workers=1, where="--device")
    check_visible([device], visible=visible, where="--device")
    return device


def run_flat_config(folder: Path) -> dict[str, Any]:
    """The run's flat config from its config.json, or a NebulaError saying the folder is not a run folder."""
    from nebula_fl.storage.run_folder import CONFIG, RunFolder

    if not folder.is_dir():
        raise NebulaError(f"'{folder}' is not a folder; pass a run folder written by `nebula-fl run` (runs/...)")
    flat = RunFolder(folder).read_config().get("run_config")
    if not isinstance(flat, dict) or not flat:
        raise NebulaError(f"'{folder}' is not a nebula-fl run folder (its {CONFIG} holds no run_config); pass a run "
                          "folder written by `nebula-fl run`")
    return flat


def open_run(folder: str | Path, *, model: str | None = None, device: str = "cpu") -> RunModel:
    """The causal-lm run in `folder` rebuilt as its server built it, its final weights found but not loaded;
    `model` replaces the config's base model path (a model moved since the run). `device`: cpu, cuda:N, or auto
    (the first GPU if there is one), as key `server-device` says it."""
    from nebula_fl.components import load
    from nebula_fl.model.locate import resolve_model_path
    from nebula_fl.storage.run_folder import ADAPTER, MODEL, SUMMARY, RunFolder
    from nebula_fl.tasks import TaskSetup, make_task

    run = RunFolder(folder)
    flat = run_flat_config(run.path)
    name = flat.get("task.name", "classify")
    if name != TASK:
        raise NebulaError(f"generate needs a {TASK} run; this run trained '{name}'")
    if model is not None:
        flat = {**flat, "model": model}
    cfg = load(flat)
    task = make_task(cfg.task.name, cfg.task_options)
    weights = run.path / (MODEL if task.exchange == "full" else ADAPTER)
    summary = run.read_summary()
    status = summary.get("status", "unknown")
    if status != "completed":
        raise NebulaError(f"the run in '{run.path}' did not complete ({SUMMARY} says status '{status}'), so it has no "
                          f"final {weights.name}; finish it with `nebula-fl run --resume {run.path}`")
    if not weights.is_file():
        raise NebulaError(f"the run in '{run.path}' has no {weights.name} (its final weights), though {SUMMARY} says "
                          "it completed; the folder is incomplete or was edited")
    try:
        path = resolve_model_path(cfg.model.model)
    except NebulaError as err:
        if model is not None:
            raise
        raise NebulaError(f"the run's base model '{cfg.model.model}' is not on this machine ({err}); pass --model "
                          "PATH to point at the base model's new location") from None
    where = torch.device(pick_device(device))
    setup = TaskSetup(model=cfg.model, labels=[], seed=cfg.federation.seed, path=path, privacy_mode=cfg.privacy.mode,
                      device=where)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # greedy decoding with a config that sets sampling knobs warns on every call
    return RunModel(folder=run.path, task=task, model=task.build_model(setup).eval(), tokenizer=task.tokenizer(setup),
                    weights=weights, model_name=cfg.model.model, summary=summary)


def compare(run: RunModel, request: GenerateRequest) -> list[Comparison]:
    """Each prompt's greedy completion by the run's starting model, then by the tuned one (final weights loaded)."""
    base = [run.complete(p, max_new_tokens=request.max_new_tokens) for p in request.prompts]
    run.load_final()
    tuned = [run.complete(p, max_new_tokens=request.max_new_tokens) for p in request.prompts]
    return [Comparison(prompt=p, base=b, tuned=t) for p, b, t in zip(request.prompts, base, tuned, strict=True)]


def report(run: RunModel, request: GenerateRequest, results: Sequence[Comparison]) -> dict[str, Any]:
    """The machine-readable result (``--json``)."""
    return {"run": str(run.folder), "task": TASK, "model": run.model_name, "exchange": run.task.exchange,
            "weights": run.weights.name, "rounds_completed": run.summary.get("rounds_completed"),
            "max_new_tokens": request.max_new_tokens, "completions": [r.to_dict() for r in results]}


def render(console, result: Mapping[str, Any]) -> None:
    """A table: each prompt, the base model's completion and the tuned one's (… where the token limit cut it)."""
    from rich.table import Table
    from rich.text import Text

    def shown(c: Mapping[str, Any]) -> Text:
        return Text(c["text"] + ("" if c["stopped"] else " …"))

    console.print(f"run {result['run']}: {result['task']} on {result['model']}, {result['exchange']} exchange, "
                  f"{result['rounds_completed']} round(s); greedy, at most {result['max_new_tokens']} new tokens "
                  "(… = cut by the limit)", markup=False, soft_wrap=True)
    table = Table(show_lines=True)
    for column in ("prompt", "base", "tuned"):
        table.add_column(column, overflow="fold")
    for c in result["completions"]:
        tuned = shown(c["tuned"])
        if not c["changed"]:
            tuned.append(" (unchanged)", style="dim")
        table.add_row(Text(c["prompt"]), shown(c["base"]), tuned)
    console.print(table)


def generate_main(folder: str, *, prompts: Sequence[str], max_new_tokens: int, model: str | None, device: str,
                  as_json: bool, console) -> int:
    import json

    request = GenerateRequest(prompts=tuple(prompts), max_new_tokens=max_new_tokens)
    with warnings.catch_warnings():  # the libraries' notes to developers, not to someone reading completions
        for module in ("peft", "transformers"):
            warnings.filterwarnings("ignore", category=UserWarning, module=module)
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        run = open_run(folder, model=model, device=device)
        result = report(run, request, compare(run, request))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        render(console, result)
    return 0
