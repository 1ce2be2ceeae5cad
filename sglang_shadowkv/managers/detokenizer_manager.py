"""The server's detokenizer process (SGLang's arrangement): the scheduler's token outputs in,
cumulative text out to the tokenizer manager."""

from __future__ import annotations

import zmq

from sglang_shadowkv.managers.child_process import die_with_parent
from sglang_shadowkv.managers.request_output import decode_text
from sglang_shadowkv.managers.io_struct import TextOut, TokenOut
from sglang_shadowkv.managers.request_output import format_logprobs


class Detokenizer:
    """Cumulative text per running request, from batches of new token ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.output_ids: dict[str, list[int]] = {}

    def handle(self, out: TokenOut) -> TextOut:
        ids = self.output_ids.setdefault(out.rid, [])
        ids.extend(out.new_ids)
        if out.finished:
            del self.output_ids[out.rid]
        text = "" if out.error else decode_text(self.tokenizer, ids, out.sampling,
                                                 out.meta["finish_reason"], final=out.finished)
        logprobs = None if out.logprobs is None else format_logprobs(self.tokenizer, out.logprobs)
        return TextOut(out.rid, text, out.new_ids, out.finished, out.meta, out.error, logprobs)


def run_detokenizer_process(tokenizer_pipe, from_scheduler: str, to_tokenizer_manager: str, status_pipe) -> None:
    """Started together with the scheduler (its imports overlap the model load); tokenizer_pipe
    then brings the scheduler's tokenizer. status_pipe: told once the sockets are up and the
    tokenizer is here, so the launcher serves only when every process is."""
    die_with_parent()
    context = zmq.Context()
    recv = context.socket(zmq.PULL)
    recv.bind(from_scheduler)
    send = context.socket(zmq.PUSH)
    send.connect(to_tokenizer_manager)
    detokenizer = Detokenizer(tokenizer_pipe.recv())
    status_pipe.send({})
    while True:
        batch: list[TokenOut] = recv.recv_pyobj()
        send.send_pyobj([detokenizer.handle(out) for out in batch])
