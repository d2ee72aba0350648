"""Hypothesis strategies for session mixes (imported by tests; hypothesis is a test dependency)."""
from __future__ import annotations

from hypothesis import strategies as st

from ds4t.exactness.harness import Plan, Scenario


@st.composite
def scenarios(draw, vocab: int, max_sessions: int = 16, max_prompt: int = 200, max_steps: int = 40,
              max_ctx: int = 512) -> Scenario:
    """1..max_sessions sessions with prompts of 1..max_prompt tokens, 1..max_steps steps,
    sessions joining and leaving at drawn steps, some joining through a chunk in a mixed batch;
    the row order is permuted every step (seeded)."""
    steps = draw(st.integers(1, max_steps))
    n = draw(st.integers(1, max_sessions))
    plans = []
    for i in range(n):
        plen = draw(st.integers(1, max_prompt))
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=plen, max_size=plen))
        join = 0 if i == 0 else draw(st.integers(0, steps - 1))
        leave = draw(st.one_of(st.just(10**9), st.integers(join + 1, steps)))
        plans.append(Plan(prompt, join, leave, chunked_join=draw(st.booleans())))
    return Scenario(plans, steps, seed=draw(st.integers(0, 2**31 - 1)), max_ctx=max_ctx)
