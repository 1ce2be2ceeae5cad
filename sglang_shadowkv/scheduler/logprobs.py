"""Log-probabilities as SGLang computes them: what a request asks for, what it has got so far, and
how a step's logits become them.

Prompt ("input") logprobs follow SGLang's rule: with logprob_start_len L, the prompt positions
L .. len-1 are reported; position L carries None (nothing before it is scored), position p > L the
logprob of token p given the tokens before it, read from the logits of position p - 1. Those
logits must be computed, so the radix-cache match stops at L (prefix_match_limit) and the prefill
returns the logits of rows L .. len-2 besides each request's last row (prompt_logit_rows). Output
logprobs are those of the sampled tokens, from the logits the sampler saw (after a grammar's mask).
Values are raw here; managers/logprob_format.py gives them SGLang's [logprob, token_id, text] shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LogprobOptions:
    """A request's logprob fields (SGLang's GenerateReqInput names), checked."""
    start_len: int = -1  # logprob_start_len: first prompt position reported; -1: no prompt logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text: bool = False  # return_text_in_logprobs

    @classmethod
    def from_fields(cls, logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None,
                    return_text_in_logprobs=None) -> "LogprobOptions":
        """Raises ValueError naming the field; None means the field's default."""
        opts = cls(-1 if logprob_start_len is None else logprob_start_len,
                   0 if top_logprobs_num is None else top_logprobs_num,
                   token_ids_logprob or None, bool(return_text_in_logprobs))
        for name, value, low in (("logprob_start_len", opts.start_len, -1),
                                 ("top_logprobs_num", opts.top_logprobs_num, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        ids = opts.token_ids_logprob
        if ids is not None and (not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r}")
        if not isinstance(return_text_in_logprobs, (bool, type(None))):
            raise ValueError("return_text_in_logprobs must be a boolean")
        return opts

    def check(self, prompt_len: int, vocab_size: int) -> None:
        if self.start_len > prompt_len:
            raise ValueError(f"logprob_start_len ({self.start_len}) is larger than the prompt "
                             f"({prompt_len} tokens)")
        if self.top_logprobs_num > vocab_size:
            raise ValueError(f"top_logprobs_num ({self.top_logprobs_num}) exceeds the vocabulary "
                             f"({vocab_size})")
        if any(t >= vocab_size for t in self.token_ids_logprob or ()):
            raise ValueError(f"token_ids_logprob must be ids in [0, {vocab_size})")

    def input_start(self, prompt_len: int) -> int:
        """The first prompt position reported (prompt_len: none)."""
        return prompt_len if self.start_len < 0 else self.start_len


@dataclass
class TokenLogprobs:
    """Logprobs of consecutive positions: the token's own, and per position the top-k and the
    asked ids' (each None where nothing is scored, empty lists when not asked for)."""
    values: list = field(default_factory=list)  # float, or None at the first prompt position
    ids: list = field(default_factory=list)
    top: list = field(default_factory=list)  # (values, ids) or None
    asked: list = field(default_factory=list)  # values of token_ids_logprob, or None

    def since(self, start: int) -> "TokenLogprobs":
        return TokenLogprobs(self.values[start:], self.ids[start:], self.top[start:], self.asked[start:])


@dataclass
class LogprobDelta:
    """What a step added to a request's logprobs (the prompt's come once, when it is done)."""
    options: LogprobOptions
    input: TokenLogprobs | None
    output: TokenLogprobs


@dataclass
class ReqLogprobs:
    """A request's logprobs so far, and how much of them has been sent on."""
    options: LogprobOptions
    input: TokenLogprobs
    output: TokenLogprobs = field(default_factory=TokenLogprobs)
    input_done: bool = False
    input_sent: bool = False
    output_sent: int = 0

    @classmethod
    def for_prompt(cls, options: LogprobOptions, input_ids: list[int]) -> "ReqLogprobs":
        start = options.input_start(len(input_ids))
        first = TokenLogprobs()
        if start < len(input_ids):
            _append(first, options, None, input_ids[start], None)
        return cls(options, first, input_done=start >= len(input_ids) - 1)

    def take_delta(self) -> LogprobDelta:
        send_input = self.input_done and not self.input_sent
        self.input_sent |= send_input
        delta = LogprobDelta(self.options, self.input if send_input else None,
                             self.output.since(self.output_sent))
        self.output_sent = len(self.output.values)
        return delta

    def everything(self) -> LogprobDelta:
        return LogprobDelta(self.options, self.input, self.output)


def prefix_match_limit(req) -> int:
    """Prompt tokens the radix cache may supply: all but the last (its logits give the first new
    token) and none from logprob_start_len on (their logits must be computed)."""
    limit = len(req.input_ids) - 1
    if req.logprob is not None:
        limit = min(limit, req.logprob.options.input_start(len(req.input_ids)))
    return limit


@dataclass
class StepLogitRows:
    """Which rows of a step the forward returns logits for, when prompt logprobs need more than
    each request's last row."""
    rows: list[int]  # rows of the flattened step
    last: list[int]  # per item, where its last row is in the returned logits
    prompt: list[tuple[int, int, int, int]]  # (item, first returned row, count, first position)


def prompt_logit_rows(reqs, items) -> StepLogitRows | None:
    """The step's logit rows, or None when no request needs prompt logprobs in it."""
    rows, last, prompt, offset = [], [], [], 0
    for i, (req, item) in enumerate(zip(reqs, items)):
        begin, end = item.start, item.seq_len
        if req.logprob is not None and not req.logprob.input_done:
            first = max(req.logprob.options.input_start(len(req.input_ids)), begin)
            stop = min(len(req.input_ids) - 1, end)
            if first < stop:
                prompt.append((i, len(rows), stop - first, first))
                rows.extend(range(offset + first - begin, offset + stop - begin))
        last.append(len(rows))
        rows.append(offset + end - begin - 1)
        offset += end - begin
    return StepLogitRows(rows, last, prompt) if prompt else None


def record_prompt_logprobs(reqs, logits: torch.Tensor, step: StepLogitRows) -> None:
    """Append the prompt logprobs of this step's chunk: row p scores prompt token p + 1."""
    for i, row, count, position in step.prompt:
        req = reqs[i]
        lp = req.logprob
        next_ids = req.input_ids[position + 1:position + 1 + count]
        _extend(lp.input, lp.options, torch.log_softmax(logits[row:row + count].float(), -1), next_ids)
        lp.input_done = position + count >= len(req.input_ids) - 1


def record_output_logprobs(reqs, logits: torch.Tensor, tokens: list[int], picked: list[float]) -> None:
    """Append each sampled token's logprob (picked, from the sampler), with its top-k and asked
    ids when the request wants them."""
    for j, req in enumerate(reqs):
        lp = req.logprob
        if lp is None:
            continue
        opts = lp.options
        if opts.top_logprobs_num or opts.token_ids_logprob:
            _extend(lp.output, opts, torch.log_softmax(logits[j:j + 1].float(), -1), [tokens[j]],
                    [picked[j]])
        else:
            _append(lp.output, opts, picked[j], tokens[j], None)


def _extend(span: TokenLogprobs, opts: LogprobOptions, logprobs: torch.Tensor, ids: list[int],
            values: list[float] | None = None) -> None:
    """Append positions scored by logprobs [n, vocab] whose tokens are ids."""
    if values is None:
        values = logprobs.gather(1, torch.tensor(ids, device=logprobs.device)[:, None]).squeeze(1).tolist()
    top = asked = None
    if opts.top_logprobs_num:
        top = torch.topk(logprobs, opts.top_logprobs_num, dim=-1)
        top = list(zip(top.values.tolist(), top.indices.tolist()))
    if opts.token_ids_logprob:
        asked = logprobs[:, opts.token_ids_logprob].tolist()
    for k, (value, token) in enumerate(zip(values, ids)):
        _append(span, opts, value, token, (top[k] if top else None, asked[k] if asked else None))


def _append(span: TokenLogprobs, opts: LogprobOptions, value, token: int, extras) -> None:
    span.values.append(value)
    span.ids.append(token)
    top, asked = extras or (None, None)
    if opts.top_logprobs_num:
        span.top.append(top)
    if opts.token_ids_logprob:
        span.asked.append(asked)
