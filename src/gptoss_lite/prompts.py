"""Prompt phrasing shared by the training data (`train.data`) and the passkey evaluator (`evals.passkey`).

Both sides import these strings from here, so neither depends on the other. They are part of the
shipped model's results, byte for byte: the model was trained on exactly this wording (a share of its
passkey documents) and is evaluated with it, so editing a string here changes the passkey curve.
Leading spaces and newlines matter (the byte tokenizer sees them); `{key}` is the 5-digit key.
"""

# The evaluator's default template; training uses it for `eval_phrasing_prob` of its passkey documents.
NEEDLE_TEMPLATE = " The passkey is {key}."
QUESTION = "\nWhat is the 5-digit passkey? The passkey is"

# The long-context literature's wording: the evaluator's `classic` template, and one of the other
# phrasings training mixes in.
CLASSIC_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
CLASSIC_QUESTION = "\nWhat is the pass key? The pass key is"
