"""Causal language models: federated LoRA instruction tuning and continued pre-training of a decoder.

The model is any transformers ``AutoModelForCausalLM`` (a folder, a ``.gguf`` file, or the shipped 'smollm2',
SmolLM2-135M-Instruct), or with ``task.init = "scratch"`` a small Llama built from ``task.*`` sizes with the base
model's tokenizer (seeded, so every side builds the same weights without sending them). PEFT LoRA goes on the
projections PEFT targets by default for the architecture (``q_proj,v_proj`` for Llama) unless
``lora-target-modules`` names others; ``task.exchange = "full"`` trains and exchanges every weight instead (DiLoCo's
pre-training).

Data are 'text' records (``data/instructions.py``): a prompt and its answer, or plain text. Under ``objective =
"instruct"`` the prompt is formatted (the tokenizer's chat template, or a plain "### Instruction / ### Response"
one) and masked out of the loss, so only the answer and the end-of-sequence token are learned, as FlowerTune
does; plain-text records are learned whole. Under ``"pretrain"`` every token of every record is learned, unformatted.
Nothing is cut silently (``CausalRecords``): a prompt too long for ``max-seq-len`` loses the end of its input,
never its instruction or its answer, a record that cannot fit even so is dropped, plain text is packed into full
rows, and each set's ``RecordsReport`` counts what happened.

Evaluation: the held-out loss per learned token and its perplexity, and exact match: the share of records with a
short answer (at most ``task.exact-match-tokens`` tokens) that greedy decoding answers, once decoded, with the same
text up to case and whitespace, and how many records that covers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from nebula_fl.config import Section, check_bool, check_int, require
from nebula_fl.data.instructions import decode_turns
from nebula_fl.errors import NebulaError
from nebula_fl.model.loading import check_positions
from nebula_fl.model.lora_targets import lora_targets
from nebula_fl.tasks.base import EXCHANGES, Examples, Task, TaskSetup, check_sizes

if TYPE_CHECKING:
    from nebula_fl.privacy.sample_dp import PerExample

INITS = ("pretrained", "scratch")
BASE_DTYPES = ("fp32", "bf16", "nf4", "int8")
QUANTISED = ("nf4", "int8")  # bitsandbytes' 4-bit NormalFloat (QLoRA) and 8-bit bases
OBJECTIVES = ("instruct", "pretrain")
TEMPLATES = ("auto", "chat", "plain")
PLAIN_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
IGNORE = -100


@dataclass(kw_only=True, frozen=True)
class CausalLMOptions(Section):
    """The decoder, what is learned and exchanged, and how prompts are formatted (``task.*`` keys)."""

    PREFIX: ClassVar[str] = "task"

    init: str = "pretrained"
    """'pretrained': load `model` as a causal LM; 'scratch': a Llama of the sizes below, with `model`'s tokenizer."""
    exchange: str = "adapter"
    """'adapter': LoRA is trained and crosses the WAN; 'full': every weight (pre-training)."""
    objective: str = "instruct"
    """'instruct': learn the answers, prompts masked; 'pretrain': learn every token of every record."""
    template: str = "auto"
    """How an instruction prompt is formatted: 'chat' (the tokenizer's chat template), 'plain' (### Instruction /
    ### Response), or 'auto' (chat when the tokenizer has a template)."""
    layers: int = 2
    """Decoder layers of a 'scratch' model; 1 to 48."""
    hidden: int = 64
    """Hidden size of a 'scratch' model; 8 to 4,096, a multiple of `heads`."""
    heads: int = 4
    """Attention heads of a 'scratch' model; 1 to 64."""
    intermediate: int = 128
    """Feed-forward width of a 'scratch' model; 8 to 16,384."""
    exact_match_tokens: int = 16
    """Answers of at most this many tokens count towards exact match; 1 to 256."""
    base_dtype: str = "fp32"
    """The base's weights: 'fp32'; 'bf16' (half the memory); 'nf4' or 'int8' (a frozen 4-bit NormalFloat or 8-bit
    base through bitsandbytes, QLoRA; a pretrained model only). LoRA and what crosses the WAN stay fp32. Other than
    'fp32': the adapter only (not task.exchange=full), and not under per-example DP."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass: much less memory for long sequences, for about a
    third more compute."""

    def __post_init__(self) -> None:
        for key, value, allowed in (("init", self.init, INITS), ("exchange", self.exchange, EXCHANGES),
                                    ("objective", self.objective, OBJECTIVES), ("template", self.template, TEMPLATES)):
            require(isinstance(value, str) and value in allowed, f"task.{key}", f"is {value!r}",
                     f"use one of {', '.join(allowed)}")
        check_sizes(layers=self.layers, hidden=self.hidden, heads=self.heads, intermediate=self.intermediate)
        require((self.hidden // self.heads) % 2 == 0, "task.hidden", f"/ task.heads is {self.hidden // self.heads}, "
                 "odd", "make the head size (hidden / heads) even: rotary embeddings rotate pairs")
        check_int("task.exact-match-tokens", self.exact_match_tokens, low=1, high=256, fix="use 1 to 256 tokens")
        require(isinstance(self.base_dtype, str) and self.base_dtype in BASE_DTYPES, "task.base-dtype",
                f"is {self.base_dtype!r}", f"use one of {', '.join(BASE_DTYPES)}")
        require(self.base_dtype == "fp32" or self.exchange == "adapter", "task.base-dtype",
                f"is {self.base_dtype!r} with task.exchange='full'", "keep fp32 weights when every weight trains "
                "(--precision bf16 computes in bf16 all the same)")
        require(self.base_dtype not in QUANTISED or self.init == "pretrained", "task.base-dtype",
                f"is {self.base_dtype!r} with task.init='scratch'", "quantise a pretrained model, or use fp32 or bf16")
        check_bool("task.gradient-checkpointing", self.gradient_checkpointing)


# -- prompts ----------------------------------------------------------------------------------------------
def end_token(tokenizer) -> int:
    """The token that ends an answer: the tokenizer's end of sequence (a chat model's end of turn), else BERT's
    [SEP]."""
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return int(token_id)
    raise NebulaError("the tokenizer has no end-of-sequence token (eos or sep); use a model whose tokenizer has one")


def pad_token(tokenizer) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_token(tokenizer))


def uses_chat(tokenizer, template: str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has:
        raise NebulaError("task.template is 'chat', but the model's tokenizer has no chat template; use 'plain' or "
                          "'auto'")
    return template == "chat" or (template == "auto" and has)


def format_prompt(tokenizer, prompt: str, *, template: str) -> str:
    """The text the model sees before its answer (also what ``nebula-fl generate`` feeds it)."""
    if uses_chat(tokenizer, template):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    return PLAIN_TEMPLATE.format(prompt=prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` after the beginning-of-sequence token where the tokenizer adds one (Llama's, Mistral's), unless the
    text already starts with it (a chat template that writes it)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or not getattr(tokenizer, "add_bos_token", False) or (ids and ids[0] == bos):
        return ids
    return [int(bos), *ids]


def prompt_ids(tokenizer, prompt: str, *, template: str) -> list[int]:
    """The formatted prompt as the model reads it before its answer, in training and in generation alike."""
    return with_bos(tokenizer, _ids(tokenizer, format_prompt(tokenizer, prompt, template=template)))


def _special_ids(tokenizer) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i in tokenizer.all_special_ids} | {int(i) for i, tok in added.items()
                                                          if getattr(tok, "special", False)}


def turn_end(tokenizer, *, template: str) -> list[int]:
    """The tokens that close an answer, learned after each one: what the chat template writes after an
    assistant's text, trailing whitespace aside (ChatML's <|im_end|>, Gemma's <end_of_turn>, Llama 3's <|eot_id|>,
    Mistral's </s>), with EOS after it unless it holds a special token already; under the plain template, EOS.
    A base model whose template's turn end is not its EOS (Qwen base, Gemma) thus learns the template's."""
    eos = end_token(tokenizer)
    if not uses_chat(tokenizer, template):
        return [eos]
    probe = "nebula-answer-probe"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}],
                                         tokenize=False)
    after = text[text.rindex(probe) + len(probe):].rstrip() if probe in text else ""
    ids = _ids(tokenizer, after) if after else []
    return ids if _special_ids(tokenizer) & set(ids) else [*ids, eos]


def stop_tokens(tokenizer, *, template: str, end: list[int] | None = None) -> list[int]:
    """Where greedy decoding stops: the template's turn-end token (the first special one it writes) and EOS
    (`end`: ``turn_end``'s tokens, when the caller has them)."""
    special = _special_ids(tokenizer)
    end = turn_end(tokenizer, template=template) if end is None else end
    return list(dict.fromkeys([*[t for t in end if t in special][:1], end_token(tokenizer)]))


def until_stop(ids: list[int], stops: Sequence[int]) -> tuple[list[int], bool]:
    """Generated `ids` up to the first stop token, and whether one came (else the token limit cut them)."""
    end = next((k for k, t in enumerate(ids) if t in stops), None)
    return (ids, False) if end is None else (ids[:end], True)


def conversation_pieces(tokenizer, turns: Sequence[tuple[str, str]], answer: str, *, template: str,
                        end: list[int] | None = None) -> list[tuple[list[int], bool]]:
    """A multi-turn record as (token ids, learned) pieces: the template's text up to each answer masked, and each
    assistant turn with its turn end learned. Under a chat template the pieces are cut from the template rendered
    over the whole conversation (each answer's prefix is the template's own rendering of the turns before it with
    the generation prompt, as ``generate`` feeds a prompt), so what is learned is what the model will say."""
    messages = [*turns, ("assistant", answer)]
    end = turn_end(tokenizer, template=template) if end is None else end  # (`end`: the caller's, computed once)
    pieces: list[tuple[list[int], bool]] = []
    if not uses_chat(tokenizer, template):
        system = [c for r, c in messages[:1] if r == "system"]
        lead = f"{system[0]}\n\n" if system else ""
        for role, content in messages[len(system):]:
            if role == "user":
                pieces.append((_ids(tokenizer, lead + PLAIN_TEMPLATE.format(prompt=content)), False))
                lead = ""
            else:
                pieces.append(([*_ids(tokenizer, content), *end], True))
    else:
        done = ""
        for k, (role, content) in enumerate(messages):
            if role != "assistant":
                continue
            history = [{"role": r, "content": c} for r, c in messages[:k]]
            prefix = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
            if not prefix.startswith(done):
                raise NebulaError("the model's chat template renders a conversation's earlier turns differently once "
                                  "later turns follow, so no one rendering serves every answer; split each "
                                  "conversation into one record per answer, or set task.template='plain'")
            pieces.append((_ids(tokenizer, prefix[len(done):]), False))
            pieces.append(([*_ids(tokenizer, content), *end], True))
            full = tokenizer.apply_chat_template([*history, {"role": "assistant", "content": content}],
                                                 tokenize=False)
            done = full.rstrip()
    first, learned = pieces[0]
    pieces[0] = (with_bos(tokenizer, first), learned)
    return pieces


def fit_prompt(tokenizer, prompt: str, *, template: str, budget: int) -> tuple[list[int] | None, bool]:
    """(the formatted prompt's ids in at most `budget` tokens, whether its input was cut), or (None, False) when
    even its instruction alone does not fit. A prompt is its instruction, then its input after the first blank
    line (``data/instructions.prompt_text``): only the input is cut, from its end; never the instruction."""
    ids = prompt_ids(tokenizer, prompt, template=template)
    if len(ids) <= budget:
        return ids, False
    instruction, sep, text = prompt.partition("\n\n")
    if sep:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                            verbose=False)["offset_mapping"]
        keep = len(offsets) - (len(ids) - budget)
        for _ in range(8):  # re-tokenising after the cut can merge or split a token at the edge
            if keep <= 0:
                break
            ids = prompt_ids(tokenizer, f"{instruction}\n\n{text[: offsets[keep - 1][1]]}", template=template)
            if len(ids) <= budget:
                return ids, True
            keep -= len(ids) - budget
    ids = prompt_ids(tokenizer, instruction, template=template)
    return (ids, True) if sep and len(ids) <= budget else (None, False)


@dataclass(kw_only=True)
class RecordsReport:
    """What became of a set of records at `max-seq-len`: nothing is cut silently."""

    max_len: int
    records: int = 0
    """Records given."""
    rows: int = 0
    """Rows made: one per instruction record kept, and the full sequences plain text was packed into."""
    cut: int = 0
    """Instruction records whose input was shortened to fit (the instruction and the answer whole)."""
    dropped: int = 0
    """Instruction records left out: the instruction and the answer alone are longer than `max-seq-len` (for a
    conversation: its first exchange)."""
    conversations: int = 0
    """Multi-turn records (every assistant turn learned)."""
    turns_cut: int = 0
    """Multi-turn records shortened to fit: their later exchanges left out, every kept answer whole."""
    text_tokens: int = 0
    """Tokens of the plain-text records (each document's with its BOS and EOS)."""
    text_tokens_kept: int = 0
    """Of those, the tokens in a row: all when packed; under per-example DP each document is one row, cut."""
    packed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"max_seq_len": self.max_len, "records": self.records, "rows": self.rows, "inputs_cut": self.cut,
                "dropped": self.dropped, "conversations": self.conversations,
                "conversations_shortened": self.turns_cut, "text_tokens": self.text_tokens,
                "text_tokens_kept": self.text_tokens_kept, "packed": self.packed}

    def describe(self) -> str:
        parts = [f"{self.records:,} record(s) -> {self.rows:,} row(s) of at most {self.max_len} tokens"]
        if self.cut:
            parts.append(f"{self.cut:,} with their input shortened to fit (instruction and answer whole)")
        if self.dropped:
            parts.append(f"{self.dropped:,} dropped: instruction and answer alone exceed max-seq-len")
        if self.turns_cut:
            parts.append(f"{self.turns_cut:,} of {self.conversations:,} conversations shortened to their first "
                         "exchanges that fit (each kept answer whole)")
        if self.text_tokens:
            how = "packed" if self.packed else "one row per document (per-example DP), cut at max-seq-len"
            parts.append(f"plain text {how}: {self.text_tokens_kept:,} of {self.text_tokens:,} tokens kept")
        return "; ".join(parts)


class CausalRecords:
    """Records as token ids with the positions to learn, padded per batch (right padding, labels -100).

    An instruction record is its formatted prompt (masked) and its whole answer with the end token; when they do
    not fit, the prompt's input is shortened, and a record whose instruction and answer alone do not fit is
    dropped: counted in `report`, never cut silently. Plain text (and every record under `objective="pretrain"`)
    is learned whole: each document with BOS (where the tokenizer uses one) and EOS, packed into full rows of
    `max_len` tokens, none thrown away. Under per-example DP (`pack=False`) a row must be one record, the unit
    the privacy accounting counts, so each document is one row, cut at `max_len`, and the report says how many
    tokens that left out."""

    def __init__(self, tokenizer, prompts: Sequence[str], answers: Sequence[str], *, max_len: int, objective: str,
                 template: str, exact_match_tokens: int, pack: bool = True) -> None:
        self.tokenizer = tokenizer  # exact match decodes what the model generates
        self.pad_id, self.eos = pad_token(tokenizer), end_token(tokenizer)
        instruct = objective == "instruct"
        end = turn_end(tokenizer, template=template) if instruct else [self.eos]
        self.stops = stop_tokens(tokenizer, template=template, end=end) if instruct else [self.eos]
        self.end_len = len(end)
        self.ids: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.answers: list[str | None] = []  # a short answer, which exact match compares a generated one with
        self.prompt_lens: list[int] = []  # the masked prompt before it
        self.report = RecordsReport(max_len=max_len, records=len(prompts), packed=pack)
        stream: list[int] = []
        for prompt, answer in zip(prompts, answers, strict=True):
            answer, turns = str(answer), decode_turns(prompt)
            self.report.conversations += turns is not None
            if turns is not None and answer:
                pieces = conversation_pieces(tokenizer, turns, answer, template=template,
                                             end=end if instruct else None)
                if instruct:
                    self._add_conversation(pieces, max_len=max_len)
                    continue
                document = [t for ids, _ in pieces for t in ids]
            elif not instruct or not answer:
                text = f"{prompt}\n\n{answer}" if answer else prompt
                document = [*with_bos(tokenizer, _ids(tokenizer, text)), self.eos]
            else:
                answer_ids = _ids(tokenizer, answer)
                target = [*answer_ids, *end]
                ids, cut = fit_prompt(tokenizer, prompt, template=template, budget=max_len - len(target))
                if ids is None:
                    self._drop()
                    continue
                self.report.cut += int(cut)
                self._add(ids + target, learn_from=len(ids),
                          answer=answer if len(answer_ids) <= exact_match_tokens else None)
                continue
            self.report.text_tokens += len(document)
            if pack:
                stream.extend(document)
            else:
                self._add(document[:max_len], learn_from=0)
        for start in range(0, len(stream), max_len):
            self._add(stream[start : start + max_len], learn_from=0)
        self.report.rows = len(self.ids)

    def _add_conversation(self, pieces: list[tuple[list[int], bool]], *, max_len: int) -> None:
        """A multi-turn record up to its last answer that fits whole: later exchanges are left out and counted;
        a record whose first answer does not fit is dropped."""
        ids: list[int] = []
        labels: list[int] = []
        kept = 0
        for piece, learned in pieces:
            if len(ids) + len(piece) > max_len:
                break
            ids += piece
            labels += piece if learned else [IGNORE] * len(piece)
            kept = len(ids) if learned else kept
        if not kept:
            self._drop()
            return
        self.report.turns_cut += kept < sum(len(piece) for piece, _ in pieces)
        self._add(ids[:kept], labels=labels[:kept])

    def _drop(self) -> None:
        """A record that cannot fit: counted; under per-example DP (`pack=False`) it still takes its row, with
        nothing learned (zero gradient), because Opacus samples rows and the accounting counts records."""
        self.report.dropped += 1
        if not self.report.packed:
            self._add([self.eos, self.eos], labels=[IGNORE, IGNORE])

    def _add(self, ids: list[int], *, learn_from: int = 0, labels: list[int] | None = None,
             answer: str | None = None) -> None:
        if labels is None and not learn_from:
            self.report.text_tokens_kept += len(ids)
        if len(ids) < 2:  # a row learns from its second token on: one token alone gets the end token after it
            ids = [*ids, self.eos]
        if labels is None:
            labels = [IGNORE] * learn_from + ids[learn_from:]
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.labels.append(np.asarray(labels, dtype=np.int64))
        self.answers.append(answer)
        self.prompt_lens.append(learn_from)

    def __len__(self) -> int:
        return len(self.ids)

    def learned_tokens(self) -> int:
        """Positions whose token is learned (a record's first token never is: nothing precedes it)."""
        return int(sum(int((lab[1:] != IGNORE).sum()) for lab in self.labels))

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        rows = [int(i) for i in np.asarray(indices).reshape(-1)]
        width = max((len(self.ids[i]) for i in rows), default=1)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for j, i in enumerate(rows):
            n = len(self.ids[i])
            ids[j, :n], labels[j, :n], mask[j, :n] = self.ids[i], self.labels[i], 1
        batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                 "labels": torch.from_numpy(labels)}
        return {k: v.to(device) for k, v in batch.items()}


# -- the maths ------------------------------------------------------------------------------------------
def shifted_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) for next-token prediction, at the learned positions' columns only: position t's logits
    predict token t + 1. Only columns where some row learns a token are projected onto the vocabulary (for
    instruction data, the answers: the vocabulary projection of every prompt token is skipped). Targets are -100
    where nothing is learned."""
    targets = batch["labels"][:, 1:]
    columns = torch.nonzero((targets != IGNORE).any(0)).flatten()
    keep: Any = columns if len(columns) < targets.shape[1] else 0
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep).logits
    if isinstance(keep, int):
        return logits[:, :-1], targets
    return logits, targets[:, columns]


def example_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, learned tokens) per example."""
    mask = targets != IGNORE
    ce = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                     ignore_index=IGNORE, reduction="none").view(targets.shape)
    return (ce * mask).sum(1), mask.sum(1)


def normalise_answer(text: str) -> str:
    """An answer as exact match compares it: case folded, whitespace runs as one space, none at the ends."""
    return " ".join(text.casefold().split())


def generated_exact_match(model: nn.Module, records: CausalRecords, *, batch_size: int,
                          max_new_tokens: int) -> tuple[int, int]:
    """(hits, records scored): each record with a short answer is answered by greedy decoding from its prompt
    (left-padded batches, stopped at the turn end or EOS), decoded and compared normalised with its answer."""
    from transformers import GenerationConfig

    rows = [i for i, answer in enumerate(records.answers) if answer is not None]
    config = GenerationConfig(do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
                              min_new_tokens=0, max_new_tokens=max_new_tokens, eos_token_id=records.stops,
                              pad_token_id=records.pad_id)
    device = next(model.parameters()).device
    hits = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [records.ids[i][: records.prompt_lens[i]] for i in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(chunk), width), records.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, prompt in enumerate(prompts):  # left padding: every row's answer starts at the same column
            ids[j, width - len(prompt):], mask[j, width - len(prompt):] = torch.from_numpy(prompt), 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for j, i in enumerate(chunk):
            answer, _ = until_stop([int(t) for t in out[j, width:]], records.stops)
            text = records.tokenizer.decode(answer, skip_special_tokens=True)
            hits += normalise_answer(text) == normalise_answer(str(records.answers[i]))
    return hits, len(rows)


class CausalLMTask(Task):
    name = "causal-lm"
    exchange = "adapter"
    targets = "text"
    metrics = ("loss", "perplexity", "exact-match", "exact-match-records", "tokens")
    metric = "loss"
    higher_is_better = False
    privacy_modes = ("off", "sample", "client")
    Options = CausalLMOptions
    # The decoder LoRA recipes' rate (QLoRA, TRL's examples: 1e-4 to 2e-4) with their 3% warm-up, and TRL's
    # default length, which holds most instruction records whole (the BBC view: 110 inputs of 2,225 cut at 1,024,
    # none dropped; benchmarks/causal.py)
    defaults: ClassVar[dict[str, Any]] = {"lr": 2e-4, "lr-warmup-ratio": 0.03, "max-seq-len": 1024}
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # Every code path in seconds: a 1-layer Llama of width 64 with MiniLM's tokenizer, LoRA on it.
        "smoke": {
            "task.init": "scratch", "task.layers": 1, "task.hidden": 64, "task.heads": 2, "task.intermediate": 128,
            "dataset": "bbcnews", "max-examples": 200, "max-seq-len": 64, "local-steps": 3, "batch-size": 4,
            "num-server-rounds": 2, "lr": 1e-3, "eval-initial": False, "lora-target-modules": "q_proj,v_proj",
        },
        # SmolLM2-135M-Instruct (shipped, pretrained) tuned with LoRA to name a BBC article's topic; two clusters
        # with topic-skewed data, sized to take minutes on 2 cores.
        "demo": {
            "model": "smollm2", "dataset": "bbcnews", "max-examples": 600, "max-seq-len": 96,
            "partition": "dirichlet:1.0", "local-steps": 10, "batch-size": 4,
            "num-server-rounds": 4, "lr": 5e-4, "eval-batch-size": 16, "lora-target-modules": "q_proj,v_proj",
        },
    }

    def __init__(self, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options=options)
        self.opts: CausalLMOptions = self.options  # type: ignore[assignment]
        self.exchange = self.opts.exchange  # type: ignore[misc]

    # -- the model ----------------------------------------------------------------------------------------
    def build_model(self, setup: TaskSetup) -> nn.Module:
        if self.opts.base_dtype != "fp32" and setup.privacy_mode == "sample":
            raise NebulaError(f"task.base-dtype is {self.opts.base_dtype!r}, but per-example DP (privacy.mode "
                              "'sample') computes each record's gradient through an fp32 base; use fp32")
        with torch.random.fork_rng(devices=[]):  # seeded construction, the caller's RNG stream left as it was
            torch.manual_seed(setup.seed)
            model = self._scratch(setup) if self.opts.init == "scratch" else self._pretrained(setup)
            if self.opts.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.exchange == "full":
                return model.to(setup.device)
            model = self._lora(model, setup)
        # a quantised base was loaded onto its device: bitsandbytes' weights cannot be moved after
        return model if self.opts.base_dtype in QUANTISED else model.to(setup.device)

    def _scratch(self, setup: TaskSetup) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        o, tokenizer = self.opts, self.tokenizer(setup)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=o.hidden, num_hidden_layers=o.layers,
                             num_attention_heads=o.heads, num_key_value_heads=o.heads, intermediate_size=o.intermediate,
                             max_position_embeddings=max(self.seq_len(setup), 8), tie_word_embeddings=True,
                             pad_token_id=pad_token(tokenizer), eos_token_id=end_token(tokenizer), bos_token_id=None)
        return LlamaForCausalLM(config).to(self._dtype())

    def _dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.opts.base_dtype == "bf16" else torch.float32

    def _pretrained(self, setup: TaskSetup) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from nebula_fl.model.gguf_cache import model_folder

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        fix = "pass model=smollm2, a causal LM's folder or .gguf file, or set task.init=scratch"
        try:
            folder = model_folder(setup.path)  # a GGUF file: its dequantised folder, made once per host
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise NebulaError(f"could not read the model in '{setup.path}': {str(err).splitlines()[0]}; "
                              f"{fix}") from None
        architectures = getattr(config, "architectures", None) or []
        if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            raise NebulaError(f"the model in '{setup.path}' is a {', '.join(architectures)}, not a causal language "
                              f"model; {fix}")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=self._dtype(),
                                                         **self._quantised(setup))
        except (OSError, ValueError) as err:
            raise NebulaError(f"could not load '{setup.path}' as a causal LM: {str(err).splitlines()[0]}; "
                              f"{fix}") from None
        check_positions(model.config, max_seq_len=self.seq_len(setup), path=setup.path)
        return model

    def _quantised(self, setup: TaskSetup) -> dict[str, Any]:
        """transformers' arguments for a bitsandbytes base (none for fp32 or bf16), or a one-line refusal."""
        if self.opts.base_dtype not in QUANTISED:
            return {}
        # bitsandbytes looks for faster kernels on the Hugging Face Hub at import unless offline: nebula-fl never
        # downloads at run time (its own CPU and CUDA code is used instead)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise NebulaError(f"task.base-dtype is {self.opts.base_dtype!r}, which needs bitsandbytes, not installed "
                              "on this host: pip install 'bitsandbytes>=0.50' on every host that loads the model "
                              "(the ServerApp's and each cluster's), or use fp32 or bf16") from None
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if setup.device.type == "cuda" else torch.float32
        quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
                 if self.opts.base_dtype == "nf4" else BitsAndBytesConfig(load_in_8bit=True))
        return {"quantization_config": quant, "device_map": {"": str(setup.device)}}

    def _lora(self, model: nn.Module, setup: TaskSetup) -> nn.Module:
        from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

        from nebula_fl.model.frozen_a import freeze_shared_a, lora_mode

        if self.opts.base_dtype in QUANTISED:  # norms in fp32, inputs that carry gradients (PEFT's QLoRA recipe)
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=self.opts.gradient_checkpointing,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
            for module in model.modules():
                # bitsandbytes 0.50 repacks a 4-bit weight for fast CPU inference at the first forward in eval mode
                # without gradients, for good, and a later training step through it gets no gradient: evaluation
                # would silently end training. Inference keeps bitsandbytes' other CPU path.
                if hasattr(module, "support_avx512bf16_for_cpu"):
                    module.support_avx512bf16_for_cpu = False
        elif self.opts.gradient_checkpointing:
            model.enable_input_require_grads()  # a frozen embedding's output must carry gradients to the LoRA layers

        targets = lora_targets(model, setup.model, model_type=getattr(model.config, "model_type", ""))
        lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=setup.model.lora_r, lora_alpha=setup.model.alpha,
                          lora_dropout=setup.model.lora_dropout,  # PEFT reads 'all-linear' only as a bare string
                          target_modules="all-linear" if targets == ["all-linear"] else targets)
        peft = get_peft_model(model, lora)
        if lora_mode(requested=setup.model.lora_mode, privacy_mode=setup.privacy_mode) == "frozen-a":
            freeze_shared_a(peft, seed=setup.seed)
        return peft

    # -- data, loss, evaluation ---------------------------------------------------------------------------
    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> CausalRecords:
        records = CausalRecords(tokenizer, texts, [str(a) for a in labels], max_len=self.seq_len(setup),
                                objective=self.opts.objective, template=self.opts.template,
                                exact_match_tokens=self.opts.exact_match_tokens,
                                pack=not (train and setup.privacy_mode == "sample"))
        if texts and not len(records):
            raise NebulaError(f"every one of the {len(texts):,} records is longer than max-seq-len "
                              f"({self.seq_len(setup)}) with its instruction and answer alone; raise max-seq-len")
        return records

    def private_examples(self, data: Examples) -> PerExample:
        """Records sampled by index, in chunks of similar lengths, one row per record (a dropped record's row
        learns nothing). ``record_loss`` weighs every record the same, as Opacus's per-example mean needs."""
        from nebula_fl.privacy.sample_dp import indexed

        records: CausalRecords = data  # type: ignore[assignment]
        return indexed(records, loss=self.record_loss,
                       lengths=np.array([len(x) for x in records.ids], dtype=np.int64))

    def format_prompt(self, tokenizer, prompt: str) -> str:
        """What the model is fed before it answers `prompt`, as in training (for generation)."""
        if self.opts.objective == "pretrain":
            return prompt
        return format_prompt(tokenizer, prompt, template=self.opts.template)

    def prompt_ids(self, tokenizer, prompt: str) -> list[int]:
        """`format_prompt`'s text as token ids, with BOS where training puts one (for generation)."""
        return with_bos(tokenizer, _ids(tokenizer, self.format_prompt(tokenizer, prompt)))

    def stop_tokens(self, tokenizer) -> list[int]:
        """Where generation stops: the chat template's turn end and EOS (EOS alone for plain or raw text)."""
        if self.opts.objective == "pretrain":
            return [end_token(tokenizer)]
        return stop_tokens(tokenizer, template=self.opts.template)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean loss over the batch's learned tokens (TRL's and transformers' convention: a long answer counts
        for its tokens), as the held-out loss is measured. Per-example DP uses ``record_loss`` instead."""
        logits, targets = shifted_logits(model, batch)
        summed, counts = example_losses(logits, targets)
        if not bool((counts > 0).any()):
            return logits.sum() * 0.0
        return summed.sum() / counts.sum()

    def record_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean over the batch's records of each record's mean learned-token loss (every record weighs the
        same, however long its answer: one example, one unit, as per-example DP counts it). A dropped record's row
        learns nothing and adds 0, still counted in the mean, as Opacus's per-example mean needs."""
        logits, targets = shifted_logits(model, batch)
        summed, counts = example_losses(logits, targets)
        return (summed / counts.clamp(min=1)).mean()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Examples, *, batch_size: int) -> dict[str, float]:
        """Loss per learned token over the whole set and its perplexity; exact match: the share of the records with
        a short answer whose greedy generation, decoded, equals the answer up to case and whitespace (NaN when
        the set has none, e.g. plain text), with how many records it covers; and how many tokens were scored."""
        records: CausalRecords = data  # type: ignore[assignment]
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        total, tokens = 0.0, 0
        try:
            for start in range(0, len(records), batch_size):
                batch = records.batch(np.arange(start, min(start + batch_size, len(records))), device)
                logits, targets = shifted_logits(model, batch)
                summed, counts = example_losses(logits, targets)
                total += float(summed.sum())
                tokens += int(counts.sum())
            hits, answers = generated_exact_match(model, records, batch_size=batch_size,
                                                  max_new_tokens=self.opts.exact_match_tokens + records.end_len)
        finally:
            model.train(was_training)
        if tokens == 0:
            raise ValueError("the held-out records have no token to learn; use longer texts or more of them")
        loss = total / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "exact-match": hits / answers if answers else float("nan"), "exact-match-records": float(answers),
                "tokens": float(tokens)}
