"""generate(): text or token prompts -> generated tokens, N sessions decoded together in batched steps.

Each prompt gets its own session. The prompts are prefilled together (one ``eval_batch`` call per
chunk of ``prefill_chunk`` tokens of every prompt not yet consumed), then every step feeds the last
token of each unfinished session in ONE ``eval_batch`` call; a session leaves the batch when it
samples a stop token or reaches its token budget. Tokens are chosen by :func:`ds4t.sampling.sample`,
whose draw for a prompt depends only on its logits, its settings and (seed, position): together
with the batch-invariant kernels, a prompt generates the same tokens alone or beside any others.
"""
from __future__ import annotations

import dataclasses
import secrets
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from ds4t import sampling
from ds4t.batch.engine import MODES, DecodeItem, eval_batch
from ds4t.batch.speculative import SpecItem, spec_step
from ds4t.batch.speculative import prefill as spec_prefill
from ds4t.batch.session import as_token_list, is_int

Prompt = Union[str, Sequence[int], np.ndarray, torch.Tensor]


@dataclasses.dataclass
class Generation:
    """What :func:`generate` produced for one prompt."""

    prompt_tokens: List[int]  # the prompt's token ids (encoded when it was text)
    tokens: List[int]         # generated ids, a stop token included as the last one
    text: Optional[str]       # the generated ids as text without the stop token; None without a tokenizer
    finish_reason: str        # "stop": a stop token was sampled; "length": max_new_tokens or the context limit
    drafted: int = 0          # with mtp: draft tokens verified
    accepted: int = 0         # with mtp: drafts equal to the model's own choice
    calls: int = 0            # forward calls after the prefill that advanced this prompt


def _codec(model):
    """The model's text codec (tokenizer, EOS ids), or None when it has no tokenizer."""
    if getattr(model, "tokenizer", None) is None:
        return None
    from ds4t.text import TextCodec

    return TextCodec.for_model(model)


def _prompt_ids(model, codec, prompts) -> List[List[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of prompts (texts or token-id lists), got "
                         f"{type(prompts).__name__}{' (wrap one prompt in a list)' if isinstance(prompts, str) else ''}")
    out = []
    for i, p in enumerate(prompts):
        if is_int(p):   # [5, 6] is two prompts of one token: almost never meant
            raise ValueError(f"prompt {i} is the int {p!r}: each prompt is a text or a list of token ids "
                             f"(one prompt of ids: prompts=[[{p}, ...]])")
        if isinstance(p, str):
            if codec is None:
                raise ValueError(f"prompt {i}: model {model.name!r} has no tokenizer; pass token ids instead of text")
            ids = codec.encode(p)
        else:
            ids = as_token_list(p, model.vocab_size, f"prompt {i}")
        if not ids:
            raise ValueError(f"prompt {i}: no tokens")
        if len(ids) > model.max_position:
            raise ValueError(f"prompt {i}: {len(ids)} tokens exceed the model's max_position_embeddings {model.max_position}")
        out.append(ids)
    return out


def generate(model, prompts: Sequence[Prompt], max_new_tokens: Union[int, Sequence[int]] = 16,
             temperature=0.0, top_p=1.0, top_k=0, seed=None,
             stop_token_ids: Optional[Sequence[int]] = None, mode: str = "auto",
             prefill_chunk: int = 256, mtp: int = 0) -> List[Generation]:
    """Generate up to ``max_new_tokens`` tokens for each prompt; returns one :class:`Generation` per prompt.

    prompts: a list of texts (encoded with ``model.tokenizer``) and/or token ids (list of ints,
    numpy array or 1-D integer tensor). temperature, top_p, top_k, seed and max_new_tokens are one
    value for every prompt or a list with one per prompt (rules: :func:`ds4t.sampling.sample`;
    temperature below :data:`ds4t.sampling.MIN_TEMPERATURE`, the default 0, is greedy). seed: an
    int (every prompt draws from it: equal prompts give equal completions), a list, or None (a
    fresh random seed per prompt, not reproducible). stop_token_ids: generation of a prompt ends
    after one of them is sampled; None: the checkpoint's EOS ids (none for presets), ``()``: never
    stop early. mode: ``eval_batch``'s mode ("auto" runs natively where the model allows).
    mtp: speculative decoding with k = ``mtp`` drafts per step from the model's MTP head
    (:mod:`ds4t.batch.speculative`): the same tokens as without it, bit for bit, in fewer calls
    when drafts are accepted; each Generation reports drafted / accepted / calls.

    A prompt's tokens do not depend on the other prompts. Every session opened is closed on
    return, also on error. Invalid arguments raise ValueError naming the prompt before any work.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    if not is_int(mtp) or mtp < 0:
        raise ValueError(f"mtp must be an int >= 0, got {mtp!r}")
    if mtp and getattr(model, "mtp", None) is None:
        raise ValueError(f"mtp={mtp}: model {model.name!r} has no MTP head (its checkpoint holds no MTP weights)")
    codec = _codec(model)
    ids = _prompt_ids(model, codec, prompts)
    n = len(ids)
    budgets = sampling.per_row("max_new_tokens", max_new_tokens, n)
    temps, tps, tks = (sampling.per_row(k, v, n) for k, v in
                       (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)))
    seeds = [secrets.randbits(63) for _ in range(n)] if seed is None else sampling.per_row("seed", seed, n)
    for i in range(n):
        what = f"prompt {i}: "
        if not is_int(budgets[i]) or budgets[i] < 1:
            raise ValueError(f"{what}max_new_tokens must be an int >= 1, got {budgets[i]!r}")
        sampling.check_params(temps[i], tks[i], tps[i], model.vocab_size, what)
        if not is_int(seeds[i]):
            raise ValueError(f"{what}seed must be an int, got {seeds[i]!r}")
    if stop_token_ids is None:
        stops = set(codec.eos_ids) if codec is not None else set()
    else:
        stops = set(as_token_list(list(stop_token_ids), model.vocab_size, "stop_token_ids"))

    sessions = []
    try:
        for p, b in zip(ids, budgets):
            # the last sampled token is never fed back: a prompt needs len(p) + b - 1 positions
            sessions.append(model.new_session(max_ctx=min(len(p) + int(b) - 1, model.max_position)))
        logits = _prefill(sessions, ids, prefill_chunk, mode, spec_history=bool(mtp))
        out = [Generation(p, [], None, "") for p in ids]
        toks = sampling.sample(logits, temperature=temps, top_k=tks, top_p=tps, seed=seeds,
                               position=[s.pos for s in sessions]).tolist()
        active = []
        for i, t in enumerate(toks):
            if _emit(out[i], [t], stops, budgets[i], sessions[i]):
                active.append(i)
        while active:
            if mtp:
                items = [SpecItem(sessions[i], out[i].tokens[-1], k=mtp, temperature=temps[i], top_k=tks[i],
                                  top_p=tps[i], seed=seeds[i], stop=frozenset(stops),
                                  max_tokens=budgets[i] - len(out[i].tokens)) for i in active]
                results, _ = spec_step(items, mode=mode)
                new = [r.tokens for r in results]
                for i, r in zip(active, results):
                    out[i].drafted += r.drafted
                    out[i].accepted += r.accepted
            else:
                logits = eval_batch([DecodeItem(sessions[i], out[i].tokens[-1]) for i in active], mode=mode).logits
                new = [[t] for t in sampling.sample(
                    logits, temperature=[temps[i] for i in active], top_k=[tks[i] for i in active],
                    top_p=[tps[i] for i in active], seed=[seeds[i] for i in active],
                    position=[sessions[i].pos for i in active]).tolist()]
            keep = []
            for i, t in zip(active, new):
                out[i].calls += 1
                if _emit(out[i], t, stops, budgets[i], sessions[i]):
                    keep.append(i)
            active = keep
    finally:
        for s in sessions:
            s.close()
    if codec is not None:
        for g in out:
            body = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens
            g.text = codec.decode(body)
    return out


def _emit(g: Generation, toks: List[int], stops, budget: int, s) -> bool:
    """Append a step's tokens; False when the prompt is done (a stop token, its budget or the context).
    FloatingPointError when the model's logits held a NaN (sampling's NO_TOKEN): there is no token to emit."""
    if sampling.NO_TOKEN in toks:
        raise FloatingPointError(f"the model's logits hold a NaN after {len(g.tokens) + toks.index(sampling.NO_TOKEN)} "
                                 f"generated tokens of a {len(g.prompt_tokens)}-token prompt: no token to choose")
    g.tokens += toks
    if g.tokens[-1] in stops:
        g.finish_reason = "stop"
    elif len(g.tokens) >= budget or s.pos >= s.max_ctx:
        g.finish_reason = "length"
    else:
        return True
    return False


def _prefill(sessions, ids: List[List[int]], chunk: int, mode: str, spec_history: bool = False) -> torch.Tensor:
    """Feed every prompt, ``chunk`` tokens of each per ``eval_batch`` call; logits fp32 [N, vocab] of
    each prompt's last position. ``spec_history``: through :func:`ds4t.batch.speculative.prefill`,
    which keeps the hiddens an MTP head drafts from."""
    last: List[Optional[torch.Tensor]] = [None] * len(ids)
    start = 0
    while True:
        rows = [i for i, p in enumerate(ids) if start < len(p)]
        if not rows:
            break
        items = [DecodeItem(sessions[i], ids[i][start:start + chunk]) for i in rows]
        logits = spec_prefill(items, mode=mode) if spec_history else eval_batch(items, mode=mode).logits
        for j, i in enumerate(rows):
            if start + chunk >= len(ids[i]):
                last[i] = logits[j]
        start += chunk
    return torch.stack(last)
