"""ds4t.generate: greedy equals a hand-written prefill + argmax loop, seeded sampling does not
depend on the batch (with a negative control), sessions drop out when done and are always closed."""
import numpy as np
import pytest
import torch

import ds4t
from ds4t import BatchError, DecodeItem, eval_batch, generation, sampling

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [200, 100, 50, 25, 12, 6, 3]]


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


def greedy_loop(model, prompt, n):
    """The reference: one session alone, prefill, then argmax and one decode step per token."""
    s = model.new_session(64)
    logits = s.prefill(prompt)
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = eval_batch([DecodeItem(s, out[-1])]).logits[0]
    s.close()
    return out


def open_slots(model):
    return len(model.pool._used)


def test_greedy_equals_the_hand_written_loop(model):
    before = open_slots(model)
    out = ds4t.generate(model, PROMPTS, max_new_tokens=5, prefill_chunk=3)
    assert [g.tokens for g in out] == [greedy_loop(model, p, 5) for p in PROMPTS]
    assert [g.prompt_tokens for g in out] == PROMPTS and all(g.finish_reason == "length" for g in out)
    assert open_slots(model) == before


def sampled_alone_and_together(model, **kw):
    together = ds4t.generate(model, PROMPTS, max_new_tokens=4, temperature=1.0, top_p=0.95, top_k=50, **kw)
    alone = [ds4t.generate(model, [p], max_new_tokens=4, temperature=1.0, top_p=0.95, top_k=50,
                           **{k: [v[i]] if isinstance(v, list) else v for k, v in kw.items()})[0]
             for i, p in enumerate(PROMPTS)]
    return [g.tokens for g in together], [g.tokens for g in alone]


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    together, alone = sampled_alone_and_together(model, seed=[11, 12, 13])
    assert together == alone
    assert together != [greedy_loop(model, p, 4) for p in PROMPTS]  # it did sample
    again, _ = sampled_alone_and_together(model, seed=[11, 12, 13])
    assert again == together


def test_negative_control_a_batch_dependent_sampler_is_caught(model, monkeypatch):
    """The same check fails when the sampler's stream is the row's index in the batch."""
    real = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda logits, **kw: real(logits, **kw, stream=list(range(len(logits)))))
    together, alone = sampled_alone_and_together(model, seed=[11, 12, 13])
    assert together != alone


def test_finished_sessions_leave_the_batch(model, monkeypatch):
    sizes = []
    real = generation.eval_batch

    def spy(items, mode):
        sizes.append([len(it.token) if isinstance(it.token, list) else 1 for it in items])
        return real(items, mode=mode)

    monkeypatch.setattr(generation, "eval_batch", spy)
    stop = greedy_loop(model, PROMPTS[1], 3)[1]  # prompt 1's second greedy token
    out = ds4t.generate(model, PROMPTS, max_new_tokens=[1, 6, 3], stop_token_ids=[stop], prefill_chunk=4)
    ref1 = greedy_loop(model, PROMPTS[1], 6)
    first_stop = ref1.index(stop)
    assert out[0].tokens == greedy_loop(model, PROMPTS[0], 1) and out[0].finish_reason == "length"
    assert out[1].tokens == ref1[:first_stop + 1] and out[1].finish_reason == "stop"
    assert out[2].tokens == greedy_loop(model, PROMPTS[2], 3) and out[2].finish_reason == "length"
    prefill, decode = sizes[:2], sizes[2:]
    assert prefill == [[4, 2, 4], [1, 3]]  # chunks of 4 tokens; prompt 1 done after the first
    assert [len(s) for s in decode] == sorted((len(s) for s in decode), reverse=True)
    assert len(decode[0]) == 2 and all(len(s) >= 1 for s in decode)  # prompt 0 never decodes


def test_text_prompts_use_the_tokenizer(model):
    out = ds4t.generate(model, ["hello", np.array([104, 101, 108, 108, 111])], max_new_tokens=3)
    assert out[0].prompt_tokens == list(b"hello") and out[0].tokens == out[1].tokens
    assert out[0].text == model.tokenizer.decode(out[0].tokens) and isinstance(out[0].text, str)


def test_stop_token_is_kept_in_tokens_not_in_text(model):
    first = greedy_loop(model, PROMPTS[0], 1)[0]
    g = ds4t.generate(model, [PROMPTS[0]], max_new_tokens=5, stop_token_ids=[first])[0]
    assert g.tokens == [first] and g.finish_reason == "stop" and g.text == ""


def test_sessions_are_closed_on_error(model, monkeypatch):
    before = open_slots(model)

    def boom(items, mode):
        raise RuntimeError("step failed")

    monkeypatch.setattr(generation, "eval_batch", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        ds4t.generate(model, PROMPTS, max_new_tokens=2)
    assert open_slots(model) == before


def test_nan_logits_raise_instead_of_a_token(model, monkeypatch):
    """A NaN in the logits (a kernel or model fault) is an error naming it, not a token; sessions closed.
    Negative control: the same run with finite logits completes."""
    real = generation.eval_batch

    def nan_step(items, mode):   # the first decode step (prompt chunks come as lists) gets a NaN
        r = real(items, mode=mode)
        if all(not isinstance(it.token, list) for it in items):
            r.logits[len(items) - 1, 3] = float("nan")
        return r

    monkeypatch.setattr(generation, "eval_batch", nan_step)
    before = open_slots(model)
    with pytest.raises(FloatingPointError, match="logits hold a NaN after 1 generated tokens"):
        ds4t.generate(model, PROMPTS, max_new_tokens=3)
    assert open_slots(model) == before
    monkeypatch.setattr(generation, "eval_batch", real)
    assert all(len(g.tokens) == 3 for g in ds4t.generate(model, PROMPTS, max_new_tokens=3))


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(prompts="hello"), ValueError, "wrap one prompt in a list"),
    (dict(prompts=[]), ValueError, "non-empty list"),
    (dict(prompts=[[1], []]), ValueError, "prompt 1: no tokens"),
    (dict(prompts=[5, 6]), ValueError, r"prompt 0 is the int 5: each prompt is a text or a list of token ids"),
    (dict(prompts=[[1], [256]]), BatchError, r"prompt 1: token 256 outside the vocabulary"),
    (dict(prompts=[[1], [True]]), BatchError, "prompt 1: token True is not an int"),
    (dict(max_new_tokens=0), ValueError, "prompt 0: max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=[1, 2]), ValueError, "max_new_tokens has 2 values for 3 rows"),
    (dict(temperature=-1.0), ValueError, "prompt 0: temperature must be a finite number >= 0"),
    (dict(top_k=[0, 0, 300]), ValueError, r"prompt 2: top_k must be an int in \[0, 256\]"),
    (dict(top_p=0.0), ValueError, r"prompt 0: top_p must be a number in \(0, 1\]"),
    (dict(seed=1.5), ValueError, "prompt 0: seed must be an int"),
    (dict(stop_token_ids=[999]), BatchError, "stop_token_ids: token 999 outside"),
    (dict(mode="fast"), ValueError, "mode must be one of"),
    (dict(prefill_chunk=0), ValueError, "prefill_chunk must be a positive int"),
])
def test_invalid_arguments_are_named_and_open_nothing(model, kwargs, err, match):
    before = open_slots(model)
    args = dict(prompts=PROMPTS, max_new_tokens=2) | kwargs
    with pytest.raises(err, match=match):
        ds4t.generate(model, args.pop("prompts"), **args)
    assert open_slots(model) == before


def test_text_needs_a_tokenizer(model, monkeypatch):
    monkeypatch.setattr(model, "tokenizer", None)
    with pytest.raises(ValueError, match="prompt 0: model 'tiny-qwen' has no tokenizer"):
        ds4t.generate(model, ["hi"])
    assert ds4t.generate(model, [[1, 2]], max_new_tokens=1)[0].text is None


def test_rows_past_a_native_window_run_ordered_with_the_same_tokens():
    """GLM with native_window=4: longer prompts decode on the ordered path inside the same steps."""
    glm = ds4t.load("tiny-glm", native_window=4)
    prompts = [[3, 4], [9, 8, 7, 6, 5]]
    out = ds4t.generate(glm, prompts, max_new_tokens=3, mode="auto")
    assert [g.tokens for g in out] == [greedy_loop(glm, p, 3) for p in prompts]


def test_mtp_generates_the_same_tokens():
    """generate(mtp=k) is speculative decoding: the same tokens as plain generation, bit for bit
    (greedy and seeded sampling, a stop token), with its drafts counted."""
    m = ds4t.load("tiny-glm")
    prompts = [[1, 2, 3], [7] * 5, [200, 100]]
    kw = dict(max_new_tokens=[6, 9, 4], temperature=[0.0, 0.9, 0.5], seed=[1, 2, 3])
    plain = ds4t.generate(m, prompts, **kw)
    for k in (1, 3):
        fast = ds4t.generate(m, prompts, mtp=k, **kw)
        assert [g.tokens for g in fast] == [g.tokens for g in plain]
        assert [g.finish_reason for g in fast] == [g.finish_reason for g in plain]
        assert sum(g.drafted for g in fast) > 0
    stop = plain[1].tokens[3]
    a = ds4t.generate(m, prompts, stop_token_ids=[stop], **kw)
    b = ds4t.generate(m, prompts, stop_token_ids=[stop], mtp=2, **kw)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    with pytest.raises(ValueError, match="no MTP head"):
        ds4t.generate(ds4t.load("tiny-llama"), [[1]], mtp=2)
    with pytest.raises(ValueError, match="mtp must be"):
        ds4t.generate(m, [[1]], mtp=-1)
