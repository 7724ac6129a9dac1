"""The prompt phrasing shared by training data and the passkey evaluator is one set of strings, pinned byte for byte."""

import gptoss_lite.evals.passkey as passkey
import gptoss_lite.train.data as data
from gptoss_lite import prompts


def test_shared_phrasing_is_byte_identical_to_the_shipped_model():
    """The strings the shipped model was trained and evaluated on are unchanged (its passkey curve depends on them)."""
    assert prompts.NEEDLE_TEMPLATE == " The passkey is {key}."
    assert prompts.QUESTION == "\nWhat is the 5-digit passkey? The passkey is"
    assert prompts.CLASSIC_NEEDLE == " The pass key is {key}. Remember it. {key} is the pass key."
    assert prompts.CLASSIC_QUESTION == "\nWhat is the pass key? The pass key is"


def test_training_and_evaluator_use_the_same_objects():
    """Both sides take the phrasing from gptoss_lite.prompts, so they cannot drift apart."""
    for name in ("NEEDLE_TEMPLATE", "QUESTION", "CLASSIC_NEEDLE", "CLASSIC_QUESTION"):
        assert getattr(passkey, name) is getattr(prompts, name)
    assert data.NEEDLE_TEMPLATE is prompts.NEEDLE_TEMPLATE and data.QUESTION is prompts.QUESTION
    assert data._PASSKEY_VARIANTS[0] == (prompts.CLASSIC_NEEDLE, prompts.CLASSIC_QUESTION)
