"""Unit tests of the deterministic token model and the script book (no I/O)."""

from __future__ import annotations

from enginesim.model import TokenModel
from enginesim.scripts import MatchMode, Script, ScriptBook


def _model(seed: int = 0) -> TokenModel:
    return TokenModel(
        seed=seed, vocab_size=512, eos_token_id=2, special_token_ids={0, 1, 2, 3}, eos_probability=0.05
    )


def test_it_is_a_function_of_seed_and_context() -> None:
    assert _model().continuation([5, 6, 7], 20) == _model().continuation([5, 6, 7], 20)
    assert _model().continuation([5, 6, 7], 20) != _model(seed=1).continuation([5, 6, 7], 20)
    assert _model().continuation([5, 6, 7], 20) != _model().continuation([5, 6, 8], 20)


def test_it_continues_a_replayed_prefix_identically() -> None:
    model = _model()
    for prompt in ([9], [10, 11, 12], list(range(40, 80))):
        full = model.continuation(prompt, 30)
        for k in (1, 5, 17, 29):
            assert model.continuation(prompt + full[:k], 30 - k) == full[k:]


def test_it_never_samples_special_ids_except_eos_sometimes() -> None:
    model = _model()
    seen: set[int] = set()
    for p in range(200):
        seen.update(model.continuation([100 + p], 10))
    assert not seen & {0, 1, 3}
    assert 2 in seen  # eos does occur ...
    assert len(seen) > 100  # ... among many ordinary ids


def test_it_respects_banned_ids() -> None:
    model = _model()
    state = model.state([1, 2, 3])
    first = model.sample(state)
    assert model.sample(state, banned={first}) != first
    assert all(model.sample(model.state([p]), banned={2}) != 2 for p in range(300))


def test_it_keeps_sampleable_ids_below_the_tokenizer_size() -> None:
    model = TokenModel(seed=0, vocab_size=512, eos_token_id=2, sampleable_limit=100)
    assert max(model.continuation([5], 300)) < 100


def test_it_gives_deterministic_ranked_logprobs() -> None:
    model = _model()
    state = model.state([4, 5])
    token = model.sample(state)
    a = model.logprobs(state, token, 5)
    assert a == model.logprobs(state, token, 5)
    assert [c.rank for c in a.top] == [1, 2, 3, 4, 5]
    values = [c.logprob for c in a.top]
    assert values == sorted(values, reverse=True) and all(v < 0 for v in values)
    assert a.top[a.sampled.rank - 1] == a.sampled
    assert len({c.token_id for c in a.top}) == 5


def test_it_matches_exact_scripts_at_every_prefix() -> None:
    book = ScriptBook([Script((7, 8), (50, 51, 52))])
    assert book.next_token([7, 8]) == 50
    assert book.next_token([7, 8, 50]) == 51
    assert book.next_token([7, 8, 50, 51]) == 52
    assert book.next_token([7, 8, 50, 51, 52]) is None  # exhausted: hash model again
    assert book.next_token([1, 7, 8]) is None  # exact needs the whole context


def test_it_matches_suffix_scripts_after_any_prefix() -> None:
    book = ScriptBook([Script((7, 8), (50, 51), MatchMode.SUFFIX)])
    assert book.next_token([1, 2, 7, 8]) == 50
    assert book.next_token([1, 2, 7, 8, 50]) == 51
    assert book.next_token([7, 9]) is None


def test_it_prefers_exact_then_longest_then_newest() -> None:
    book = ScriptBook(
        [
            Script((8,), (60,), MatchMode.SUFFIX),
            Script((7, 8), (61,), MatchMode.SUFFIX),
            Script((7, 8), (62,), MatchMode.EXACT),
        ]
    )
    assert book.next_token([7, 8]) == 62
    assert book.next_token([1, 7, 8]) == 61
    assert book.next_token([1, 8]) == 60
    newer = book.with_script(Script((7, 8), (63,), MatchMode.EXACT))
    assert newer.next_token([7, 8]) == 63
    assert len(newer.scripts) == 3  # replaced, not added
