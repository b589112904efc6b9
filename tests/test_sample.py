"""The generation engine (minigpt.core.generate, and minigpt.infer.sample's text layer) on tiny
random-init models: no training needed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minigpt.config import MinigptError, ModelConfig
from minigpt.core.generate import (
    context_keep,
    filter_logits,
    generate,
    sample_token,
    truncate_prompt,
)
from minigpt.core.gpt import GPT
from minigpt.core.sampling import MAX_NEW_TOKENS, Sampling
from minigpt.errors import ArgumentError
from minigpt.infer.sample import TextStream, sample

POS_ENCODINGS = ("rope", "learned", "sinusoidal", "none")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_gpt(pos_encoding: str = "rope", block_size: int = 16, vocab_size: int = 64,
             seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size,
                      vocab_size=vocab_size, pos_encoding=pos_encoding, **kw)
    return GPT(cfg).eval()


def utf8_decode(ids) -> str:
    """A byte-level tokenizer's decode: id = byte value."""
    return bytes(ids).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# Argument checks


@pytest.mark.parametrize("temperature, top_k, top_p, n, param", [
    (-0.1, 0, 1.0, 10, "temperature"),
    (math.nan, 0, 1.0, 10, "temperature"),
    (math.inf, 0, 1.0, 10, "temperature"),
    (1.0, -1, 1.0, 10, "top_k"),
    (1.0, 0, 0.0, 10, "top_p"),
    (1.0, 0, 1.01, 10, "top_p"),
    (1.0, 0, math.nan, 10, "top_p"),
    (1.0, 0, 1.0, 0, "max_new_tokens"),
    (1.0, 0, 1.0, MAX_NEW_TOKENS + 1, "max_new_tokens"),
])
def test_bad_sampling_settings_name_the_parameter(temperature, top_k, top_p, n, param):
    with pytest.raises(ArgumentError, match=f"^{param}: ") as err:
        Sampling(temperature, top_k, top_p, n)
    assert err.value.param == param


def test_edge_sampling_settings_are_accepted():
    Sampling(0.0, 0, 1.0, 1)
    Sampling(2.5, 5, 1e-6, MAX_NEW_TOKENS)


# --------------------------------------------------------------------------------------------
# Filtering: the allowed set, computed independently, and draws never outside it


def reference_top_p_set(probs: list[float], p: float) -> set[int]:
    """Smallest set of most-likely tokens with total probability >= p (plain Python)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i]
        if total >= p:
            break
    return kept


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_allowed_set_and_renormalised_probs(k):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(50, generator=gen) * 3
    filtered = filter_logits(logits, temperature=0.7, top_k=k)
    allowed = set(torch.topk(logits, k).indices.tolist())
    assert set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist()) == allowed
    # Inside the set the distribution is the tempered softmax renormalised.
    idx = torch.tensor(sorted(allowed))
    want = torch.softmax(logits[idx] / 0.7, dim=0)
    assert torch.allclose(torch.softmax(filtered, 0)[idx].float(), want, atol=1e-6)
    draws = {sample_token(logits, 0.7, k, 1.0, gen) for _ in range(300)}
    assert draws <= allowed
    if k > 1:
        assert len(draws) > 1  # it really samples


@pytest.mark.parametrize("p", [1e-4, 0.3, 0.8, 0.95])
def test_top_p_matches_reference_and_draws_stay_inside(p):
    gen = torch.Generator().manual_seed(2)
    for trial in range(5):
        logits = torch.randn(40, generator=gen) * (1 + trial)
        filtered = filter_logits(logits, temperature=1.0, top_p=p)
        allowed = reference_top_p_set(torch.softmax(logits.double(), 0).tolist(), p)
        assert set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist()) == allowed
        draws = {sample_token(logits, 1.0, 0, p, gen) for _ in range(100)}
        assert draws <= allowed


def test_top_k_then_top_p():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(30, generator=gen)
    top = torch.topk(logits, 8).indices
    probs_k = torch.softmax(logits[top].double(), 0).tolist()
    allowed = {int(top[i]) for i in reference_top_p_set(probs_k, 0.6)}
    filtered = filter_logits(logits, 1.0, top_k=8, top_p=0.6)
    assert set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist()) == allowed
    assert {sample_token(logits, 1.0, 8, 0.6, gen) for _ in range(200)} <= allowed


def test_off_values_leave_the_distribution_alone():
    logits = torch.randn(20)
    assert torch.equal(filter_logits(logits, 1.0, 0, 1.0), logits.double())
    assert torch.equal(filter_logits(logits, 1.0, 20, 1.0), logits.double())  # k >= V = off


def test_top_p_keeps_the_exact_smallest_set_at_the_boundary():
    """Issue #15 finding 6: top_p a hair above the mass of the k most likely tokens needs
    k + 1 of them, a hair below needs k (cumsum - probs used to drift by ~1e-7)."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert int(torch.isfinite(filter_logits(logits, 1.0, 0, 0.8000001)).sum()) == 3
    assert int(torch.isfinite(filter_logits(logits, 1.0, 0, 0.7999999)).sum()) == 2
    gen = torch.Generator().manual_seed(11)
    for trial in range(20):
        logits = torch.randn(64, generator=gen) * (0.5 + trial / 4)
        probs = sorted(torch.softmax(logits.double(), 0).tolist(), reverse=True)
        for k in (1, 2, 5, 17, 40):
            mass = math.fsum(probs[:k])  # exact sum of the k most likely
            for top_p, want in ((mass * (1 + 1e-9), k + 1), (mass * (1 - 1e-9), k)):
                if top_p < 1.0:
                    kept = int(torch.isfinite(filter_logits(logits, 1.0, 0, top_p)).sum())
                    assert kept == want, (trial, k, top_p)


@pytest.mark.parametrize("temperature", [1e-8, 1e-40, 1e-300, 5e-324])
def test_tiny_temperature_is_greedy_and_stable(temperature):
    """Issue #15 finding 2: logits / 1e-40 overflows; the result is the argmax (no NaN,
    never an id >= V). With tied largest logits it draws among the tied ones only."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        logits = torch.randn(257, generator=gen) * 5
        filtered = filter_logits(logits, temperature)
        assert not torch.isnan(filtered).any()
        assert sample_token(logits, temperature, generator=gen) == int(logits.argmax())
    logits = torch.zeros(10)
    logits[[3, 7]] = 2.0
    draws = {sample_token(logits, temperature, generator=gen) for _ in range(200)}
    assert draws == {3, 7}


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.floats(-1e4, 1e4), st.just(-math.inf)), min_size=1,
                       max_size=40).filter(lambda v: any(math.isfinite(x) for x in v)),
       temperature=st.one_of(st.floats(5e-324, 1e-30), st.floats(1e-30, 1e30)),
       top_k=st.integers(0, 45), top_p=st.floats(1e-9, 1.0), seed=st.integers(0, 2**32))
def test_a_drawn_id_is_always_inside_the_allowed_set(values, temperature, top_k, top_p, seed):
    logits = torch.tensor(values)
    filtered = filter_logits(logits, temperature, top_k, top_p)
    tok = sample_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    assert 0 <= tok < len(values) and math.isfinite(filtered[tok])


class _BadAfter(torch.nn.Module):
    """A real tiny GPT whose logits turn to `value` (NaN, +inf) from forward call n+1 on."""

    def __init__(self, gpt: GPT, n: int, value: float):
        super().__init__()
        self.gpt, self.cfg, self.n, self.value, self.calls = gpt, gpt.cfg, n, value, 0

    def new_kv_cache(self, *a, **kw):
        return self.gpt.new_kv_cache(*a, **kw)

    def forward(self, idx, kv_cache=None):
        logits, loss = self.gpt(idx, kv_cache=kv_cache)
        self.calls += 1
        if self.calls > self.n:
            logits = logits.clone()
            logits[..., 5] = self.value
        return logits, loss


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-40])
def test_non_finite_logits_stop_with_an_error_naming_the_step(value, temperature):
    """Issue #15 finding 2: never a token id from NaN/inf logits (greedy argmax would pick
    the NaN); the error names the generation step."""
    model = _BadAfter(tiny_gpt(), n=3, value=value)  # prefill + 2 decode steps are fine
    got = []
    with pytest.raises(MinigptError, match="^generation step 4: .*not finite"):
        got.extend(generate(model, [1, 2], 10, temperature=temperature,  # keeps what came
                            generator=torch.Generator().manual_seed(0)))
    assert len(got) == 3 and all(0 <= tok < 64 for tok in got)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_distribution(temperature):
    """20k draws from a known 5-token distribution: frequencies within 4 sigma."""
    base = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = base.log()  # log 0 = -inf: must never be drawn
    probs = base ** (1 / temperature)
    probs = probs / probs.sum()  # softmax(logits / T)
    gen = torch.Generator().manual_seed(6)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(logits, temperature, 0, 1.0, gen)
                                          for _ in range(n)]), minlength=5).float()
    sigma = (n * probs * (1 - probs)).sqrt()
    assert counts[4] == 0
    assert torch.all((counts - n * probs).abs() <= 4 * sigma + 1e-6), counts


def test_temperature_zero_is_argmax_and_draws_nothing():
    gen = torch.Generator().manual_seed(4)
    state = gen.get_state()
    logits = torch.randn(100, generator=torch.Generator().manual_seed(5))
    assert sample_token(logits, 0.0, 5, 0.5, gen) == int(logits.argmax())
    assert torch.equal(gen.get_state(), state)


# --------------------------------------------------------------------------------------------
# generate(): the KV cache against a full recompute


def run(model, prompt, n, **kw) -> tuple[list[int], list[torch.Tensor]]:
    logits = []
    toks = list(generate(model, prompt, n, on_logits=lambda x: logits.append(x.clone()), **kw))
    return toks, logits


@pytest.mark.parametrize("pos", POS_ENCODINGS)
def test_cache_equals_recompute_greedy_every_step(pos):
    model = tiny_gpt(pos, block_size=16)
    prompt = [1, 5, 9, 2, 7]
    n = 40  # crosses block_size several times: window jumps and re-prefills are covered
    cached, logits_c = run(model, prompt, n, temperature=0.0)
    plain, logits_p = run(model, prompt, n, temperature=0.0, use_kv_cache=False)
    assert cached == plain and len(cached) == n
    for step, (a, b) in enumerate(zip(logits_c, logits_p)):
        assert torch.allclose(a, b, atol=1e-4, rtol=0), f"{pos}: step {step} differs"


@pytest.mark.parametrize("pos", POS_ENCODINGS)
def test_cache_logits_equal_independent_full_forward(pos):
    """Within the context, step i's logits are the model's logits on prompt + tokens so far,
    computed here with one plain forward (no sampler code involved)."""
    model = tiny_gpt(pos, block_size=32)
    prompt = [3, 1, 4, 1, 5]
    gen = torch.Generator().manual_seed(0)
    toks, logits = run(model, prompt, 27, temperature=1.0, generator=gen)
    seq = torch.tensor([prompt + toks])
    with torch.no_grad():
        full = model(seq)[0][0]  # (T, V)
    for i, step_logits in enumerate(logits):
        assert torch.allclose(step_logits, full[len(prompt) - 1 + i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("pos", POS_ENCODINGS)
def test_cache_equals_recompute_when_sampling(pos):
    model = tiny_gpt(pos, block_size=12)
    kw = {"temperature": 1.3, "top_k": 20, "top_p": 0.9}
    a = list(generate(model, [0], 50, generator=torch.Generator().manual_seed(7), **kw))
    b = list(generate(model, [0], 50, generator=torch.Generator().manual_seed(7),
                      use_kv_cache=False, **kw))
    assert a == b


def test_windows_after_block_size_follow_the_documented_policy():
    """Past block_size the model sees the last `context_keep` tokens, re-prefilled."""
    block = 8
    model = tiny_gpt("learned", block_size=block)
    prompt = [1, 2, 3]
    toks, logits = run(model, prompt, 20, temperature=0.0)
    seq = prompt + toks
    start = 0
    with torch.no_grad():
        for i, step_logits in enumerate(logits):
            end = len(prompt) + i  # tokens known before step i
            if end - start > block:
                start = end - context_keep(block)
            want = model(torch.tensor([seq[start:end]]))[0][0, -1]
            assert torch.allclose(step_logits, want, atol=1e-5, rtol=0), f"step {i}"
    assert start > 0


@pytest.mark.parametrize("pos", POS_ENCODINGS)
def test_generation_continues_past_block_size(pos):
    model = tiny_gpt(pos, block_size=8)
    toks = list(generate(model, [1], 30, temperature=1.0,
                         generator=torch.Generator().manual_seed(0)))
    assert len(toks) == 30 and all(0 <= t < 64 for t in toks)


def test_long_prompt_is_windowed_and_truncate_prompt():
    model = tiny_gpt("learned", block_size=8)  # learned positions would fail on > 8 tokens
    long_prompt = list(range(20))
    ids, dropped = truncate_prompt(long_prompt, 8)
    assert ids == list(range(12, 20)) and dropped == 12
    assert truncate_prompt([1, 2], 8) == ([1, 2], 0)
    a = list(generate(model, long_prompt, 5, temperature=0.0))
    b = list(generate(model, ids, 5, temperature=0.0))
    assert a == b


def test_seed_reproducible_and_seed_sensitive():
    model = tiny_gpt()

    def draw(seed):
        return list(generate(model, [0], 30, generator=torch.Generator().manual_seed(seed)))

    assert draw(11) == draw(11)
    assert draw(11) != draw(12)


def test_stop_ids_end_generation_after_the_stop_token():
    model = tiny_gpt()
    greedy = list(generate(model, [0, 1], 20, temperature=0.0))
    stop = greedy[3]
    first = greedy.index(stop)
    toks = list(generate(model, [0, 1], 20, temperature=0.0, stop_ids=[stop]))
    assert toks == greedy[:first + 1]


def test_generate_rejects_bad_prompts_and_restores_train_mode():
    model = tiny_gpt()
    with pytest.raises(MinigptError, match="at least one token"):
        list(generate(model, [], 3))
    with pytest.raises(MinigptError, match="outside"):
        list(generate(model, [64], 3))
    model.train()
    list(generate(model, [1], 3))
    assert model.training


# --------------------------------------------------------------------------------------------
# TextStream: whole characters only, stop strings in text space


def stream_all(ids, stops=(), decode=utf8_decode) -> tuple[list[str], str, bool]:
    s = TextStream(decode, stops)
    pieces = []
    for t in ids:
        pieces.append(s.push(t))
        if s.stopped:
            break
    pieces.append(s.finish())
    assert "".join(pieces) == s.text
    return pieces, s.text, s.stopped


def test_multibyte_characters_are_never_split():
    text = "héllo €uro 😀 ok"
    pieces, out, _ = stream_all(list(text.encode()))
    assert out == text
    assert all("\ufffd" not in p for p in pieces)
    # Each character comes out with its last byte, not later.
    data = text.encode()
    assert pieces[data.index("é".encode()) + 1] == "é"
    assert pieces[data.index("😀".encode()) + 3] == "😀"


def test_invalid_bytes_are_printed_as_replacement_eventually():
    data = b"a\xffb\xfe\xfe\xfe\xfe\xfe\xfec"
    _, out, _ = stream_all(list(data))
    assert out == data.decode("utf-8", errors="replace")
    _, out, _ = stream_all(list(b"ab\xe2\x82"))  # truncated at the end: finish() flushes it
    assert out == "ab\ufffd"


def test_stop_string_split_across_tokens_is_not_printed():
    pieces, out, stopped = stream_all(list(b"to be or not to be"), stops=["not"])
    assert stopped and out == "to be or "
    assert "n" not in "".join(pieces[:-1]).replace("to be or ", "", 1)


def test_earliest_stop_wins_and_held_prefix_is_released_without_a_stop():
    _, out, stopped = stream_all(list(b"abcXYdefXZ"), stops=["XZ", "def"])
    assert stopped and out == "abcXY"
    pieces, out, stopped = stream_all(list(b"abcX"), stops=["XZ"])
    assert not stopped and out == "abcX" and pieces[-1] == "X"  # held until finish


def test_stop_at_the_very_start():
    _, out, stopped = stream_all(list(b"\n\nrest"), stops=["\n\n"])
    assert stopped and out == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\u00e9\u20ac\U0001f600\n", max_size=30),
       stop=st.text(alphabet="ab\u00e9\n", min_size=1, max_size=4),
       cuts=st.lists(st.integers(1, 5), max_size=40))
@example(text="éé\n€€", stop="a", cuts=[3, 3, 1, 2, 1])  # a char split after progress
def test_stream_equals_batch_decode_then_cut_at_stop(text, stop, cuts):
    """Any split of the bytes into tokens: the released text is the full text cut before the
    first stop occurrence, and no piece ever contains a replacement character."""
    data = text.encode()
    tokens, i = [], 0  # multi-byte tokens: a "vocabulary" of byte strings via a lookup table
    for c in cuts + [len(data)]:
        if i >= len(data):
            break
        tokens.append(data[i:i + c])
        i += c
    table = {n: tok for n, tok in enumerate(tokens)}
    pieces, out, stopped = stream_all(
        list(range(len(tokens))), stops=[stop],
        decode=lambda ids: b"".join(table[j] for j in ids).decode("utf-8", errors="replace"))
    cut = text.find(stop)
    assert out == (text if cut < 0 else text[:cut])
    assert stopped == (cut >= 0)
    assert all("\ufffd" not in p for p in pieces)


# --------------------------------------------------------------------------------------------
# sample(): whole samples for the CLI


def test_sample_streams_the_same_text_it_returns_and_stops():
    model = tiny_gpt(vocab_size=256, block_size=16)
    seen: dict[int, str] = {}
    results = sample(model, [10], utf8_decode, Sampling(max_new_tokens=25, num_samples=3), seed=5,
                     on_text=lambda i, s: seen.__setitem__(i, seen.get(i, "") + s))
    assert [r.index for r in results] == [0, 1, 2]
    for r in results:
        assert seen.get(r.index, "") == r.text
        assert r.finish_reason == "length" and len(r.token_ids) == 25
        assert r.tokens_per_s > 0 and 0 < r.first_token_s <= r.seconds
    # Samples are sequential from one generator: the first is the same when asked alone.
    alone = sample(model, [10], utf8_decode, Sampling(max_new_tokens=25), seed=5)
    assert alone[0].token_ids == results[0].token_ids
    assert results[0].token_ids != results[1].token_ids

    # A stop string taken from the middle of sample 0 ends it right there.
    text = results[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    again = sample(model, [10], utf8_decode, Sampling(max_new_tokens=25), seed=5, stops=[stop])[0]
    assert again.finish_reason == "stop" and again.text == text[:text.find(stop)]


def test_sample_stop_ids_report_eot():
    model = tiny_gpt(vocab_size=256)
    greedy = list(generate(model, [0], 10, temperature=0.0))
    r = sample(model, [0], utf8_decode, Sampling(0.0, max_new_tokens=10),
               stop_ids=[greedy[2]])[0]
    assert r.finish_reason == "eot" and r.token_ids == greedy[:greedy.index(greedy[2]) + 1]


# --------------------------------------------------------------------------------------------
# One token at a time through the KV cache, for every architecture option


@pytest.mark.parametrize("kw", [
    {"pos_encoding": "rope"}, {"pos_encoding": "learned"}, {"pos_encoding": "sinusoidal"},
    {"pos_encoding": "none"}, {"norm": "rmsnorm", "bias": True},
    {"mlp": False, "tie_weights": False}, {"attn_impl": "explicit", "bias": True},
    {"pos_encoding": "learned", "bias": True, "activation": "gelu_tanh", "norm_eps": 1e-3},
])
def test_one_token_decode_steps_equal_the_full_forward(kw):
    """Prefill 5 tokens, then one token per forward until the cache is full: every step's
    logits equal the full forward's at that position, and one more token is refused."""
    model = tiny_gpt(block_size=24, **kw)
    seq = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        full, _ = model(seq)  # (1, 24, V)
        cache = model.new_kv_cache(1)
        steps = [model(seq[:, :5], kv_cache=cache)[0][0]]  # (5, V)
        steps += [model(seq[:, t:t + 1], kv_cache=cache)[0][0] for t in range(5, 24)]
        assert cache.length == 24
        assert torch.allclose(torch.cat(steps), full[0], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="do not fit the KV cache"):
            model(seq[:, :1], kv_cache=cache)
