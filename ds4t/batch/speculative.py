"""Exact speculative decoding over session batches: draft, verify every session in one call, keep.

A session here has a *pending* token: chosen from the last logits, not yet consumed. One
:func:`spec_step` advances every item by one to k + 1 tokens:

1. **Draft** k tokens per session with the model's MTP head (greedy, batched over the sessions:
   one call over each session's backlog of (hidden, next token) pairs, then k - 1 one-row calls),
   or take drafts given by the caller (a replay, for tests and benchmarks).
2. **Verify** all sessions at once: each session's chunk ``[pending, d1 .. dk]`` is one segment of
   ONE forward call (mixed with plain decode rows and prompt chunks of other sessions), with the
   logits of every row. Row j's token is chosen exactly as plain decoding would choose it at that
   position (:func:`ds4t.sampling.sample`: greedy, or the seeded draw of (seed, stream, position)).
3. **Accept** the longest prefix of drafts equal to those choices; the session emits the choices up
   to and including the first mismatch (the last is its new pending token), stopping early at a stop
   token or its token budget.
4. **Roll back** to what was emitted: the position (KV and latent caches are addressed by it) and,
   for recurrent state, the per-token states the verify chunk kept (``Model.rollback``): nothing is
   recomputed.

Why this is exact: a prompt's logits and state are bitwise the same for every prefill chunk size
and equal to decoding it token by token inside any batch (the kernels are batch- and
chunk-invariant; tested for every family). So the verify rows' logits are the bits plain decoding
would produce at those positions, the choices are the same function of them, and the kept state is
the state plain decoding reaches. With sampling the rule is the seeded draw itself: a draft is
accepted iff it equals the token plain sampling draws there, which happens with probability p(d)
-- the standard acceptance rule for a greedy (one-hot) draft -- and the emitted sequence is exactly
the non-speculative one, not only equal in distribution.

The MTP head's own KV cache lives in the session's slot (``layers.{num_layers}.*``). Its row for
position q pairs the main model's hidden h_q with the token t_{q+1}; after a verify, the accepted
positions' true hiddens are fed to the head at the start of the next step (its "catch-up"), whose
last row drafts d1. Drafts never change what is emitted, only how many tokens one call yields.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from ds4t import sampling
from ds4t.batch.engine import DecodeItem, _validate, check_mode, path_reasons
from ds4t.batch.errors import BatchError
from ds4t.batch.session import Session, as_token_list, is_int
from ds4t.step import SegmentSpec, StepBatch


@dataclasses.dataclass
class SpecItem:
    """One session's speculative step. ``token``: its pending token (chosen, not consumed).
    ``k``: tokens to draft and verify (clamped to the session's room; 0: a plain decode step).
    ``drafts``: given drafts (a replay; at least k of them) instead of the MTP head's. Token choice:
    ``temperature`` / ``top_k`` / ``top_p`` / ``seed`` as :func:`ds4t.sampling.sample`. The step
    emits at most ``max_tokens`` tokens and ends after a token in ``stop``."""

    session: Session
    token: int
    k: int = 0
    drafts: Optional[Sequence[int]] = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: FrozenSet[int] = frozenset()
    max_tokens: Optional[int] = None


@dataclasses.dataclass
class SpecResult:
    """What one item's step emitted: ``tokens`` in order (the last is the new pending token) and
    ``logits`` fp32 [len(tokens), vocab] (row j is what tokens[j] was chosen from). ``drafted`` /
    ``accepted``: drafts verified / equal to the model's choices. ``path``: "native" or "ordered"."""

    tokens: List[int]
    logits: torch.Tensor
    drafted: int
    accepted: int
    path: str


@dataclasses.dataclass
class _Backlog:
    """A session's (hidden, next token) pairs not yet fed to the MTP head, from MTP position ``start``."""

    hidden: torch.Tensor   # fp32 [n, D]: h_q for q = start .. start + n - 1
    tokens: List[int]      # [n - 1]: t_{q+1} of each pair but the last (whose token is still pending)
    start: int

    def extend(self, first: int, hidden: torch.Tensor, nxt: Sequence[int]) -> None:
        """Add consumed positions: ``first`` (the first consumed token) completes the last pair,
        ``hidden`` [m, D] are their hiddens and ``nxt`` the m - 1 tokens after all but the last."""
        if self.hidden.shape[0] > len(self.tokens):
            self.tokens.append(int(first))
        self.hidden = torch.cat([self.hidden, hidden])
        self.tokens += [int(t) for t in nxt]


def _backlog(session: Session) -> Optional[_Backlog]:
    return getattr(session, "_mtp_backlog", None)


def _set_backlog(session: Session, b: Optional[_Backlog]) -> None:
    session._mtp_backlog = b


def _record(session: Session, pos: int, toks: Sequence[int], hidden: torch.Tensor, nxt: Sequence[int]) -> None:
    """Note the MTP pairs of tokens ``toks`` consumed from ``pos``. A session whose backlog does not
    end at ``pos`` (a step without hiddens came between) starts a new one: the head's cache then
    misses those positions, which costs draft quality, never exactness."""
    b = _backlog(session)
    if b is None or b.start + b.hidden.shape[0] != pos:
        b = _Backlog(hidden[:0], [], pos)
    b.extend(toks[0], hidden, nxt)
    _set_backlog(session, b)


def _mirror(model, op: str, *args) -> None:
    """Tell the model's ``spec_hook`` (tensor-parallel serving: :class:`ds4t.parallel.mirror.Leader`) about
    a model call about to run, so that follower ranks run the same call on their shards, in order."""
    hook = getattr(model, "spec_hook", None)
    if hook is not None:
        hook(op, *args)


def _run(model, work: Sequence[Tuple[Session, SegmentSpec]], mode: str):
    """One step over (session, segment) pairs: native items in ONE forward call, the rest alone in
    item order (``model.row_reasons``). Positions are not advanced. Returns per item (logits rows,
    hidden rows or None, path)."""
    n = len(work)
    reasons = path_reasons(model, [(sp.start, len(sp.ids)) for _, sp in work], mode)
    out: List = [None] * n

    def call(idx):
        specs = [work[i][1] for i in idx]
        _mirror(model, "forward", specs)
        batch = StepBatch.build(specs, model.device)
        logits = model.forward(batch)
        r0 = h0 = 0
        for i in idx:
            sp = work[i][1]
            nl = len(sp.ids) if sp.all_logits else 1
            nh = len(sp.ids) if sp.hidden else 0
            out[i] = (logits[r0:r0 + nl], batch.hidden[h0:h0 + nh] if nh else None)
            r0, h0 = r0 + nl, h0 + nh

    native = [i for i in range(n) if reasons[i] is None]
    if native:
        call(native)
    for i in range(n):
        if reasons[i] is not None:
            call([i])
    return [(lg, h, "native" if reasons[i] is None else "ordered") for i, (lg, h) in enumerate(out)]


def prefill(items: Sequence[DecodeItem], mode: str = "auto", paths: Optional[List[str]] = None) -> torch.Tensor:
    """Consume each item's prompt chunk (as ``eval_batch``) and keep, for sessions of a model with an
    MTP head, every row's final hidden for the head's catch-up. Returns logits fp32 [N, vocab] of each
    item's last token; ``paths`` (a list, if given) is extended with each item's path ("native" /
    "ordered")."""
    check_mode(mode)
    model, work = _validate(items)
    mtp = getattr(model, "mtp", None) is not None
    res = _run(model, [(s, SegmentSpec(s.slot, toks, s.pos, hidden=mtp)) for s, toks in work], mode)
    if paths is not None:
        paths += [p for _, _, p in res]
    for (s, toks), (_, hidden, _) in zip(work, res):
        if mtp:
            _record(s, s.pos, toks, hidden, toks[1:])
        s.pos += len(toks)
        s.tokens.extend(toks)
    return torch.stack([lg[-1] for lg, _, _ in res])


def _accepted(chosen: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts equal the model's own choices, from the first (the longest agreeing prefix)."""
    a = 0
    while a < len(drafts) and chosen[a] == drafts[a]:
        a += 1
    return a


def _check(items: Sequence[SpecItem]):
    if not isinstance(items, (list, tuple)) or not items:
        raise BatchError("spec_step: empty batch")
    model, seen = None, set()
    for i, it in enumerate(items):
        if not isinstance(it, SpecItem):
            raise BatchError(f"item {i}: expected SpecItem, got {type(it).__name__}", item=i)
        s = it.session
        if not isinstance(s, Session):
            raise BatchError(f"item {i}: session is {type(s).__name__}, not a ds4t Session", item=i)
        model = model or s.model
        if s.model is not model:
            raise BatchError(f"item {i}: session belongs to another model", item=i)
        if id(s) in seen:
            raise BatchError(f"item {i}: session already in the batch", item=i)
        seen.add(id(s))
        as_token_list(it.token, model.vocab_size, f"item {i}")
        if not is_int(it.k) or it.k < 0:
            raise BatchError(f"item {i}: k must be an int >= 0, got {it.k!r}", item=i)
        if it.drafts is not None:
            d = as_token_list(list(it.drafts), model.vocab_size, f"item {i} drafts")
            if len(d) < it.k:
                raise BatchError(f"item {i}: {len(d)} drafts given for k = {it.k}", item=i)
        elif it.k and getattr(model, "mtp", None) is None:
            raise BatchError(f"item {i}: model {model.name!r} has no MTP head to draft with; pass drafts", item=i)
        if it.max_tokens is not None and (not is_int(it.max_tokens) or it.max_tokens < 1):
            raise BatchError(f"item {i}: max_tokens must be an int >= 1, got {it.max_tokens!r}", item=i)
        try:
            sampling.check_params(it.temperature, it.top_k, it.top_p, model.vocab_size, f"item {i}: ")
        except ValueError as e:
            raise BatchError(str(e), item=i) from None
        s._check_usable(f"item {i}", 1)
    return model


def _has_history(s: Session) -> bool:
    """The session's MTP backlog reaches its position (it was fed through this module since its last
    state load: a session restored from a saved state or prefilled by ``Session.prefill`` has none).
    Without it the session takes a plain step this time; its history starts there."""
    b = _backlog(s)
    return b is not None and b.hidden.shape[0] > 0 and b.start + b.hidden.shape[0] == s.pos \
        and len(b.tokens) == b.hidden.shape[0] - 1


def _mtp_drafts(model, items: List[SpecItem], ks: List[int]) -> Dict[int, List[int]]:
    """Greedy drafts from the MTP head for the items with ks[i] > 0 whose sessions have MTP history,
    batched: the catch-up call over every such session's backlog (its last row drafts d1), then one
    row per session per further draft."""
    idx = [i for i, it in enumerate(items) if ks[i] > 0 and it.drafts is None and _has_history(it.session)]
    if not idx:
        return {}
    segs, hidden = [], []
    for i in idx:
        s, it = items[i].session, items[i]
        b = _backlog(s)
        segs.append(SegmentSpec(s.slot, b.tokens + [it.token], b.start))
        hidden.append(b.hidden)
    hidden = torch.cat(hidden)
    _mirror(model, "mtp_forward", segs, hidden)
    batch = StepBatch.build(segs, model.device)
    logits = model.mtp_forward(batch, hidden)
    chain = batch.hidden.index_select(0, batch.out_rows)
    drafts = {i: [t] for i, t in zip(idx, sampling.sample(logits).tolist())}
    for i in idx:   # the backlog is in the head's cache now
        s = items[i].session
        _set_backlog(s, _Backlog(chain[:0], [], s.pos))
    for j in range(1, max(ks[i] for i in idx)):
        live = [(n, i) for n, i in enumerate(idx) if ks[i] > j and drafts[i][-1] != sampling.NO_TOKEN]
        if not live:
            break
        segs = [SegmentSpec(items[i].session.slot, [drafts[i][-1]], items[i].session.pos + j - 1) for _, i in live]
        h = chain[[n for n, _ in live]]
        _mirror(model, "mtp_forward", segs, h)
        batch = StepBatch.build(segs, model.device)
        logits = model.mtp_forward(batch, h)
        new = batch.hidden
        for (n, i), t in zip(live, sampling.sample(logits).tolist()):
            drafts[i].append(t)
        chain = chain.clone()
        chain[[n for n, _ in live]] = new
    for i in idx:   # a NaN in the head's logits ends that draft (a draft is a guess: fewer change no token)
        if sampling.NO_TOKEN in drafts[i]:
            drafts[i] = drafts[i][:drafts[i].index(sampling.NO_TOKEN)]
    return drafts


def spec_step(items: Sequence[SpecItem], extra: Sequence[DecodeItem] = (), mode: str = "auto",
              extra_paths: Optional[List[str]] = None) -> Tuple[List[SpecResult], torch.Tensor]:
    """Advance every item by a speculative step (module docstring) and run ``extra`` items (plain
    decode tokens or prompt chunks of other sessions, as ``eval_batch``) in the same verify call.

    Returns (one :class:`SpecResult` per item, logits fp32 [len(extra), vocab] of the extra items'
    last tokens); ``extra_paths`` (a list, if given) is extended with each extra item's path. Invalid
    input raises BatchError and changes no session.
    """
    check_mode(mode)
    model = _check(items)
    if extra:
        try:
            emodel, ework = _validate(list(extra))
        except BatchError as e:   # number the extra items after the speculative ones
            raise BatchError(f"extra {e}", item=None if e.item is None else len(items) + e.item) from None
        if emodel is not model:
            raise BatchError("extra items belong to another model")
        if {id(s) for s, _ in ework} & {id(it.session) for it in items}:
            raise BatchError("a session is both a speculative item and an extra item")
    else:
        ework = []
    mtp = getattr(model, "mtp", None) is not None
    ks = [min(it.k, it.session.max_ctx - it.session.pos - 1) for it in items]
    drafted = _mtp_drafts(model, list(items), ks)
    for i, it in enumerate(items):
        if it.drafts is not None:
            drafted[i] = [int(t) for t in list(it.drafts)[:ks[i]]]
    work = []
    for i, it in enumerate(items):
        s, d = it.session, drafted.get(i, [])
        work.append((s, SegmentSpec(s.slot, [int(it.token)] + d, s.pos, all_logits=True,
                                    hidden=mtp, keep=len(d) > 0)))
    work += [(s, SegmentSpec(s.slot, toks, s.pos, hidden=mtp)) for s, toks in ework]
    res = _run(model, work, mode)

    # choose every verify row's token as plain decoding would, in one sampling call
    rows, temps, tks, tps, seeds, poss = [], [], [], [], [], []
    for i, it in enumerate(items):
        lg = res[i][0]
        rows.append(lg)
        P = it.session.pos
        for j in range(lg.shape[0]):
            temps.append(it.temperature)
            tks.append(it.top_k)
            tps.append(it.top_p)
            seeds.append(it.seed)
            poss.append(P + j + 1)
    chosen = sampling.sample(torch.cat(rows), temperature=temps, top_k=tks, top_p=tps, seed=seeds,
                             position=poss).tolist()

    results, c0 = [], 0
    for i, it in enumerate(items):
        s, d = it.session, drafted.get(i, [])
        lg, hidden, path = res[i]
        ch = chosen[c0:c0 + lg.shape[0]]
        c0 += lg.shape[0]
        a = _accepted(ch, d)
        emit = ch[:a + 1]
        for j, t in enumerate(emit):
            if t in it.stop or (it.max_tokens is not None and j + 1 >= it.max_tokens):
                emit = emit[:j + 1]
                break
        n = len(emit)   # tokens consumed: the pending one and the n - 1 accepted drafts before the last emit
        P = s.pos
        if d:
            _mirror(model, "rollback", s.slot, n)
            model.rollback(s.slot, n)
        s.pos = P + n
        s.tokens.extend([int(it.token)] + d[:n - 1])
        if mtp:
            _record(s, P, [int(it.token)], hidden[:n], emit[:n - 1])
        results.append(SpecResult(emit, lg[:n], len(d), a, path))
    for (s, toks), (_, hidden, _) in zip(ework, res[len(items):]):
        if mtp:
            _record(s, s.pos, toks, hidden, toks[1:])
        s.pos += len(toks)
        s.tokens.extend(toks)
    if extra_paths is not None:
        extra_paths += [p for _, _, p in res[len(items):]]
    extra_logits = torch.stack([lg[-1] for lg, _, _ in res[len(items):]]) if ework else None
    return results, extra_logits
