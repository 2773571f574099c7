"""Sampling options (top_k, repetition / presence / frequency penalties, logprobs): validated, exact to their
formulas, and per request - a request's tokens and logprobs are the same alone and in a busy batch."""

from __future__ import annotations

import math

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.errors import InvalidRequestError
from pcr_rag.model.sampling import TokenSampler
from pcr_rag.request import (
    RagPrompt,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    chat_logprobs,
    completion_logprobs,
)
from pcr_rag.testing import TEST_DEVICE, tiny_model

DOC = "The mitochondrion is the powerhouse of the cell and makes ATP for everything else. " * 2
PROMPTS = [RagPrompt("What makes ATP?", (DOC,)), RagPrompt("Which star is closest?"),
           RagPrompt("Is TCP ordered and reliable?", (DOC,)), RagPrompt("How does merge sort work?")]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama")


def _engine(tiny, path, **kw) -> PCREngine:
    model, tok = tiny
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="32MiB", ssd_capacity=0, max_new_tokens=12,
               device=TEST_DEVICE, prefill_chunk_tokens=24, max_active=4, enable_cache=False)
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("bad", [
    dict(top_k=-2), dict(top_k=1.5), dict(top_k=True), dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
    dict(repetition_penalty=1e-300), dict(repetition_penalty=0.0099), dict(repetition_penalty=100.5),
    dict(repetition_penalty=math.inf), dict(repetition_penalty=math.nan), dict(presence_penalty=2.5),
    dict(frequency_penalty=-2.01), dict(frequency_penalty=math.nan), dict(presence_penalty="1"),
    dict(logprobs=1), dict(top_logprobs=21), dict(top_logprobs=-1), dict(top_logprobs=3),
    dict(logprobs=True, top_logprobs=2.0), dict(temperature=math.inf),
    dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=math.nan), dict(min_p="0.1"), dict(min_tokens=-1),
    dict(min_tokens=1.5), dict(min_tokens=True), dict(min_tokens=5, max_new_tokens=3), dict(ignore_eos=1),
])
def test_bad_sampling_options_are_refused_before_compute(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_top_k_minus_one_means_all_tokens_as_vllm():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams.from_kwargs(top_k=5, repetition_penalty=1.1, logprobs=True, top_logprobs=20).top_k == 5


# ---------------------------------------------------------------------------------------------- the formulas
def _sampler(prompt=(), generated=(), **params) -> TokenSampler:
    sampler = TokenSampler(SamplingParams(**params), prompt_token_ids=prompt)
    for token in generated:
        sampler.select(torch.zeros(6))  # the choice is irrelevant; accept() records what was generated
        sampler.accept(token)
    return sampler


def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.25])
    sampler = _sampler(prompt=(5,), generated=(1, 1, 2, 4), presence_penalty=0.75, frequency_penalty=0.5)
    # mu[j] - c[j] * frequency - (c[j] > 0) * presence; the prompt's token 5 is not counted
    want = torch.tensor([1.0, 2.0 - 2 * 0.5 - 0.75, 0.5 - 0.5 - 0.75, -1.0, 3.0 - 0.5 - 0.75, 0.25])
    assert torch.equal(sampler._penalize(logits.clone()), want)
    assert sampler.select(logits) == 4  # unpenalized argmax is 4 too (3 - 1.25 = 1.75 > 1.0)
    stronger = _sampler(generated=(4, 4), frequency_penalty=1.0, presence_penalty=0.5)
    assert stronger.select(logits) == 1  # 3 - 2 - 0.5 = 0.5 < 2.0: the penalty moves the greedy choice


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_answer():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.5, -0.5, 0.0])
    sampler = _sampler(prompt=(0, 99), generated=(1,), repetition_penalty=2.0)  # 99: outside the vocab, ignored
    want = torch.tensor([1.0, -2.0, 0.5, 1.5, -0.5, 0.0])
    assert torch.equal(sampler._penalize(logits.clone()), want)
    assert sampler.select(logits) == 3  # the prompt's token 0 (2.0 -> 1.0) loses the greedy choice to 1.5
    assert _sampler(generated=(1,)).select(logits) == 0


def test_a_tiny_temperature_decodes_greedily_instead_of_overflowing_to_nan():
    logits = torch.tensor([30.0, -30.0, 29.0, 0.0])
    for t in (1.4e-45, 1e-30, 9.9e-6):  # 30 / 1.4e-45 is inf in float32: inf - inf = NaN in the softmax
        assert TokenSampler(SamplingParams(temperature=t, seed=1)).select(logits) == 0


def test_top_k_keeps_the_k_best_tokens_only():
    logits = torch.tensor([0.0, 1.0, 0.9, -5.0, 0.95])
    picks = {TokenSampler(SamplingParams(temperature=5.0, top_k=2, seed=s)).select(logits) for s in range(60)}
    assert picks == {1, 4}
    picks = {TokenSampler(SamplingParams(temperature=5.0, seed=s)).select(logits) for s in range(60)}
    assert len(picks) >= 4  # without top_k the flat distribution reaches the others


def test_logprobs_are_the_models_log_softmax_with_the_top_alternatives():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    sampler = TokenSampler(SamplingParams(logprobs=True, top_logprobs=3, repetition_penalty=5.0),
                           prompt_token_ids=(1,))
    token = sampler.select(logits)
    sampler.accept(token)
    want = torch.log_softmax(logits, -1)
    (raw,) = sampler.logprobs
    assert token == 2 and raw.token_id == 2 and raw.logprob == float(want[2])  # penalties move the choice, not lp
    assert raw.top_ids == (1, 2, 0) and raw.top_logprobs == tuple(float(want[i]) for i in (1, 2, 0))
    eos = sampler.select(logits)  # chosen but never accepted (end of sequence): no entry
    assert eos is not None and len(sampler.logprobs) == 1


# ------------------------------------------------------------------------------------------------ the engine
def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_options_change_a_repetitive_greedy_answer_and_top_k_1_is_greedy(tiny, tmp_path):
    with _engine(tiny, tmp_path / "e", max_new_tokens=24) as eng:
        greedy = eng.submit(PROMPTS[1], SamplingParams()).result(timeout=120).token_ids
        assert _repeats(greedy) > 0, "the test needs a greedy answer that repeats a token"
        tiny_t = eng.submit(PROMPTS[1], SamplingParams(temperature=1e-7, seed=3)).result(timeout=120).token_ids
        top1 = eng.submit(PROMPTS[1], SamplingParams(temperature=1.3, top_k=1, seed=3)).result(timeout=120)
        rep = eng.submit(PROMPTS[1], SamplingParams(repetition_penalty=100.0)).result(timeout=120).token_ids
        freq = eng.submit(PROMPTS[1], SamplingParams(frequency_penalty=2.0)).result(timeout=120).token_ids
        pres = eng.submit(PROMPTS[1], SamplingParams(presence_penalty=2.0)).result(timeout=120).token_ids
    assert tiny_t == greedy and top1.token_ids == greedy
    assert rep != greedy and _repeats(rep) == 0
    assert freq != greedy and _repeats(freq) < _repeats(greedy)
    assert pres != greedy and _repeats(pres) < _repeats(greedy)


def test_result_and_stream_carry_openai_shaped_logprobs(tiny, tmp_path):
    with _engine(tiny, tmp_path / "e") as eng:
        params = SamplingParams(logprobs=True, top_logprobs=4)
        result = eng.submit(PROMPTS[0], params).result(timeout=120)
        chunks = list(eng.submit(PROMPTS[0], params))
        plain = eng.submit(PROMPTS[0], SamplingParams()).result(timeout=120)
    assert plain.logprobs is None and result.token_ids == plain.token_ids
    lps = result.logprobs
    assert [lp.token_id for lp in lps] == result.token_ids
    first = torch.log_softmax(result.first_token_logits.float(), -1)
    assert lps[0].logprob == float(first[result.token_ids[0]])
    for lp in lps:  # greedy: the chosen token is the most likely one, listed first among 4 in order
        assert len(lp.top_logprobs) == 4 and lp.top_logprobs[0].token_id == lp.token_id
        assert lp.top_logprobs[0].logprob == lp.logprob <= 0
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        entry = lp.as_openai()
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 4
    joined = b"".join(bytes(lp.bytes) for lp in lps)  # exact bytes, token by token (a random model's are not
    assert joined.decode("utf-8", errors="replace").startswith(result.text)  # always UTF-8: U+FFFD as decode)
    streamed = [c.logprobs for c in chunks if not c.is_final]
    assert streamed == lps[:len(streamed)] and all(c is not None for c in streamed)
    assert chunks[-1].result.logprobs == lps


OPTION_SETS = [
    SamplingParams(repetition_penalty=1.3, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0.9, top_k=7, seed=11, logprobs=True, top_logprobs=2),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, logprobs=True),
    SamplingParams(temperature=1.1, top_p=0.8, frequency_penalty=1.0, seed=5, logprobs=True, top_logprobs=20),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_option_keeps_a_request_independent_of_its_batch_company(tmp_path, dtype):
    model, tok = tiny_model("llama", dtype=dtype)
    with _engine((model, tok), tmp_path / "alone", dtype=dtype, max_new_tokens=32) as eng:
        alone = [eng.submit(p, o).result(timeout=120) for p, o in zip(PROMPTS, OPTION_SETS)]
    with _engine((model, tok), tmp_path / "busy", dtype=dtype, max_new_tokens=32) as eng:
        for shift in range(2):  # each request in company of the three others, in two arrangements
            order = [(i + shift) % 4 for i in range(4)]
            handles = {i: eng.submit(PROMPTS[i], OPTION_SETS[i]) for i in order}
            busy = {i: h.result(timeout=120) for i, h in handles.items()}
            for i in range(4):
                assert busy[i].token_ids == alone[i].token_ids, i
                assert busy[i].logprobs == alone[i].logprobs, i  # bit for bit: floats compared with ==
        generated = 2 * sum(len(r.token_ids) for r in alone)
        assert eng.executor.decode_steps < 0.7 * generated, "the requests must share decode steps"


def test_openai_shapes_are_json_safe():
    entry = TokenLogprob(7, "ab", (97, 98), -0.5, (TopLogprob(7, "ab", (97, 98), -0.5),
                                                    TopLogprob(9, "c", (99,), float("-inf"))))
    chat = chat_logprobs([entry, entry])
    assert chat["refusal"] is None and len(chat["content"]) == 2
    assert chat["content"][0]["top_logprobs"][1] == {"token": "c", "logprob": -9999.0, "bytes": [99]}
    legacy = completion_logprobs([entry, entry], text_offset=3)
    assert legacy == {"tokens": ["ab", "ab"], "token_logprobs": [-0.5, -0.5],
                      "top_logprobs": [{"ab": -0.5, "c": -9999.0}] * 2, "text_offset": [3, 5]}


# ------------------------------------------------------------------ min_p, min_tokens, ignore_eos (vLLM's)
def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    logits = torch.tensor([0.0, 1.0, 0.9, -5.0, 0.95])  # probabilities relative to the best: .37, 1, .9, .002, .95
    picks = {TokenSampler(SamplingParams(temperature=1.0, min_p=0.5, seed=s)).select(logits) for s in range(80)}
    assert picks == {1, 2, 4}
    picks = {TokenSampler(SamplingParams(temperature=1.0, seed=s)).select(logits) for s in range(80)}
    assert 0 in picks  # without min_p the token at .37 of the best is drawn now and then
    assert TokenSampler(SamplingParams(min_p=0.99)).select(logits) == 1  # greedy: min_p changes nothing


class _OnlyEnd:
    """A constraint that allows token 0 (the end) only."""

    def mask_logits(self, logits):
        logits[1:] = float("-inf")
        return logits

    def accept(self, token_id):
        pass

    def is_terminated(self):
        return False


def test_min_tokens_masks_the_end_until_that_many_tokens_were_accepted():
    logits = torch.tensor([5.0, 1.0, 2.0, 0.0])  # token 0 (end of sequence) is the greedy choice
    sampler = TokenSampler(SamplingParams(min_tokens=2), eos_ids=(0, 99))
    picks = []
    for _ in range(3):
        picks.append(sampler.select(logits))
        sampler.accept(picks[-1])
    assert picks == [2, 2, 0] and logits[0] == 5.0  # the caller's logits are left alone
    assert TokenSampler(SamplingParams(), eos_ids=(0,)).select(logits) == 0  # min_tokens=0: off
    # a grammar that allows nothing but the end is obeyed, min_tokens or not
    assert TokenSampler(SamplingParams(min_tokens=3), _OnlyEnd(), eos_ids=(0,)).select(logits) == 0


def _eos_model(eos_at: int, path):
    """A tiny model whose end-of-sequence id is the token its greedy answer to PROMPTS[1] writes at ``eos_at``
    (which it did not write before), and that answer without the end."""
    model, tok = tiny_model("llama")
    with PCREngine(model=model, tokenizer=tok, config=EngineConfig(
            cache_dir=path, chunk_size=16, dram_capacity="32MiB", ssd_capacity=0, max_new_tokens=24,
            device=TEST_DEVICE, enable_cache=False)) as eng:
        free = eng.submit(PROMPTS[1], SamplingParams()).result(timeout=120).token_ids
    index = next(i for i in range(eos_at, len(free)) if free[i] not in free[:i])
    model.config.eos_token_id = free[index]
    model.generation_config.eos_token_id = free[index]
    return (model, tok), free, index


def test_ignore_eos_and_min_tokens_decode_past_the_end(tmp_path):
    tiny, free, index = _eos_model(3, tmp_path / "free")
    eos = free[index]
    with _engine(tiny, tmp_path / "e", max_new_tokens=24) as eng:
        plain = eng.submit(PROMPTS[1], SamplingParams()).result(timeout=120)
        ignored = eng.submit(PROMPTS[1], SamplingParams(ignore_eos=True)).result(timeout=120)
        at_least = eng.submit(PROMPTS[1], SamplingParams(min_tokens=index + 3)).result(timeout=120)
        stopped = eng.submit(PROMPTS[1], SamplingParams(min_tokens=2, stop=["\x00never"])).result(timeout=120)
    assert plain.token_ids == free[:index] and plain.finish_reason == "stop"  # ends at the end token
    assert ignored.token_ids == free and ignored.finish_reason == "length"  # the end token kept, decoding went on
    assert eos in ignored.token_ids
    assert len(at_least.token_ids) >= index + 3 and eos not in at_least.token_ids[:index + 3]
    assert stopped.token_ids == free[:index]  # min_tokens below the end changes nothing


def test_min_tokens_holds_back_stop_strings(tiny, tmp_path):
    with _engine(tiny, tmp_path / "e", max_new_tokens=16) as eng:
        free = eng.submit(PROMPTS[0], SamplingParams()).result(timeout=120)
        stop = free.text[len(free.text) // 4:len(free.text) // 4 + 2]
        assert stop.strip(), "the test needs two visible characters of the answer"
        cut = eng.submit(PROMPTS[0], SamplingParams(stop=[stop])).result(timeout=120)
        held = eng.submit(PROMPTS[0], SamplingParams(stop=[stop], min_tokens=len(cut.token_ids) + 2)).result(
            timeout=120)
    assert len(cut.token_ids) < len(free.token_ids)
    assert len(held.token_ids) >= len(cut.token_ids) + 2  # vLLM: no stop string is looked for before min_tokens
    assert held.token_ids == free.token_ids[:len(held.token_ids)]


NEW_OPTION_SETS = [
    SamplingParams(temperature=1.2, min_p=0.2, seed=7, logprobs=True),
    SamplingParams(min_tokens=10, logprobs=True, top_logprobs=2),
    SamplingParams(ignore_eos=True, logprobs=True),
    SamplingParams(temperature=0.8, min_p=0.05, top_k=9, min_tokens=5, ignore_eos=True, seed=3),
]


def test_min_p_min_tokens_and_ignore_eos_keep_a_request_independent_of_its_batch_company(tmp_path):
    tiny, _, _ = _eos_model(2, tmp_path / "free")
    with _engine(tiny, tmp_path / "alone", max_new_tokens=20) as eng:
        alone = [eng.submit(p, o).result(timeout=120) for p, o in zip(PROMPTS, NEW_OPTION_SETS)]
    with _engine(tiny, tmp_path / "busy", max_new_tokens=20) as eng:
        for shift in range(2):
            order = [(i + shift) % 4 for i in range(4)]
            handles = {i: eng.submit(PROMPTS[i], NEW_OPTION_SETS[i]) for i in order}
            for i, h in handles.items():
                busy = h.result(timeout=120)
                assert busy.token_ids == alone[i].token_ids and busy.logprobs == alone[i].logprobs, i
