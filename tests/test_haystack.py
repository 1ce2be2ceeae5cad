"""The NIAH prompt builder of sglang_shadowkv.testing: needles land at their depth, prompts have their size."""

import random

import pytest

from sglang_shadowkv.testing.haystack import INTRO, MULTI_NEEDLES, NEEDLE_FORMS, grid_needles, haystack, make_needle, niah_prompt


@pytest.mark.parametrize("form", NEEDLE_FORMS)
def test_needle_lands_at_its_depth_and_prompt_has_the_asked_size(engine, form):
    tok = engine.tokenizer
    for depth in (0.0, 0.5, 1.0):
        needle = make_needle(form, random.Random(depth))
        ids = niah_prompt(engine, 1500, depth, needle)
        assert abs(len(ids) - 1500) < 30
        text = tok.decode(ids)
        assert text.count(needle.sentence) == 1 and needle.found_in(needle.sentence)
        body = text[text.index(INTRO) + len(INTRO):text.index(needle.question)]
        where = body.index(needle.sentence) / len(body)
        assert abs(where - depth) < 0.05
        assert text.endswith(needle.answer_prefix)


def test_several_needles_keep_their_order_and_unknown_forms_are_refused(engine):
    rng = random.Random(0)
    needles = [make_needle("kv", rng, word) for word in ("apple", "river", "window")]
    text = haystack(engine.tokenizer, 800, list(zip((0.8, 0.1, 0.5), needles)))
    assert text.index(needles[1].sentence) < text.index(needles[2].sentence) < text.index(needles[0].sentence)
    with pytest.raises(ValueError, match="needle form"):
        make_needle("riddle", rng)


def test_multi_needle_form_hides_look_alikes_and_asks_one(engine):
    needle, hidden = grid_needles("multikv", 0.75, random.Random(1))
    assert len(hidden) == MULTI_NEEDLES and hidden[0] == (0.75, needle)
    assert len({n.question for _, n in hidden}) == MULTI_NEEDLES  # distinct words, one shape
    text = engine.tokenizer.decode(niah_prompt(engine, 1500, 0.75, needle, hidden))
    assert all(text.count(n.sentence) == 1 for _, n in hidden) and text.count(needle.question) == 1
    body = text[text.index(INTRO) + len(INTRO):text.index(needle.question)]
    for depth, n in hidden:
        assert abs(body.index(n.sentence) / len(body) - depth) < 0.05
