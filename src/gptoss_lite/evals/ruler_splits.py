"""The RULER suite's material in two disjoint splits, `train` and `eval` (docs/ruler.md#the-split).

A split holds template families (how a fact is stated in the haystack and asked for at the end),
label words (what a fact is about), value words (the answers of `single-word`) and haystack kinds.
The suite evaluates on `eval` by default; `train` is for a training recipe to draw from, so that a
model can be trained on retrieval and still be evaluated on phrasings, words and haystacks it has
never seen. Nothing is shared between the two (tests/evals/test_ruler.py checks, and checks that
none of the `eval` material occurs in what `gptoss_lite.train.data` generates).

Placeholders: `{label}` is a rendered label ("the almanac"), `{labels}` several ("the almanac and
the quarry"), `{value}` a value, `{name}` / `{other}` variable names. Leading spaces and newlines
matter (the byte tokenizer sees them); a question's cue ends where the answer starts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SPLIT_NAMES = ("train", "eval")


@dataclass(frozen=True)
class TemplateFamily:
    """Every string one phrasing needs, for every task."""

    name: str
    intro: str  # before the haystack (may be empty)
    needle: str  # {label}, {value}
    ask: str  # one value of {label}
    hint: str  # between ask and cue: says that `none` is the answer when there is no such fact
    cue: str  # {label}; the answer follows
    ask_all: str  # every value of {label} (multi-value)
    cue_all: str
    ask_each: str  # the values of {labels} (multi-query)
    cue_each: str
    assign: str  # variable tracking: {name} gets {value}
    link: str  # {name} gets whatever {other} holds
    chain_ask: str  # {value}: which names hold it
    chain_cue: str

    def strings(self) -> tuple[str, ...]:
        """Every template string of the family (not the name)."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "name")


@dataclass(frozen=True)
class Split:
    """Template families, label words, value words and haystack kinds of one split."""

    name: str
    families: tuple[TemplateFamily, ...]
    labels: tuple[str, ...]  # what a fact is about; rendered "the <label>"
    words: tuple[str, ...]  # values of single-word needles
    haystacks: tuple[str, ...]  # kinds from gptoss_lite.evals.haystacks

    def family(self, name: str) -> TemplateFamily:
        """The family called `name`; ValueError listing this split's families otherwise."""
        for f in self.families:
            if f.name == name:
                return f
        raise ValueError(
            f"template family {name!r}: not in the {self.name} split, whose families are "
            f"{', '.join(f.name for f in self.families)}"
        )


EVAL = Split(
    name="eval",
    families=(
        TemplateFamily(  # the wording of the RULER benchmark
            name="magic",
            intro="Some special magic values are hidden within the following text. Make sure to memorize "
            "them. I will quiz you about the values afterwards.\n",
            needle=" One of the special magic values for {label} is: {value}.",
            ask="\nWhat is the special magic value for {label} mentioned in the provided text?",
            hint=" If the text mentions none, answer none.",
            cue=" The special magic value for {label} mentioned in the provided text is",
            ask_all="\nWhat are all the special magic values for {label} mentioned in the provided text?",
            cue_all=" The special magic values for {label} mentioned in the provided text are",
            ask_each="\nWhat are the special magic values for {labels} mentioned in the provided text?",
            cue_each=" The special magic values mentioned in the provided text are, in this order,",
            assign=" VAR {name} = {value}.",
            link=" VAR {name} = VAR {other}.",
            chain_ask="\nQuestion: Find all variables that are assigned the value {value} in the text above.",
            chain_cue=" Answer: According to the chain of variables assigned in the text above, the "
            "variables assigned the value {value} are",
        ),
        TemplateFamily(
            name="filed",
            intro="",
            needle=" Note that {label} was filed under {value}.",
            ask="\nUnder what was {label} filed?",
            hint=" Say none if it never was.",
            cue=" It was filed under",
            ask_all="\nName every entry that {label} was filed under.",
            cue_all=" It was filed under",
            ask_each="\nUnder what were {labels} filed, respectively?",
            cue_each=" Respectively, they were filed under",
            assign=" Let {name} stand for {value}.",
            link=" Let {name} stand for {other}.",
            chain_ask="\nWhich names stand for {value}, directly or through another name?",
            chain_cue=" The names standing for {value} are",
        ),
        TemplateFamily(
            name="ledger",
            intro="",
            needle=" Ledger entry: {label} -> {value}.",
            ask="\nLook up {label} in the ledger.",
            hint=" Write none if there is no entry.",
            cue=" Ledger lookup: {label} ->",
            ask_all="\nLook up every ledger entry for {label}.",
            cue_all=" Ledger lookup, all entries: {label} ->",
            ask_each="\nLook up {labels} in the ledger.",
            cue_each=" Ledger lookup, in that order ->",
            assign=" Ledger alias: {name} -> {value}.",
            link=" Ledger alias: {name} -> {other}.",
            chain_ask="\nWhich ledger aliases lead to {value}?",
            chain_cue=" Aliases that lead to {value}:",
        ),
    ),
    labels=(
        "almanac",
        "bulletin",
        "cathedral",
        "dossier",
        "estuary",
        "foundry",
        "gazebo",
        "harpoon",
        "isthmus",
        "kestrel",
        "lagoon",
        "monsoon",
        "nebula",
        "obelisk",
        "pavilion",
        "quarry",
        "rampart",
        "sextant",
        "trellis",
        "viaduct",
        "windmill",
        "zeppelin",
    ),
    words=(
        "marigold",
        "tourmaline",
        "saffron",
        "peridot",
        "cinnabar",
        "obsidian",
        "verbena",
        "magnolia",
        "lavender",
        "tamarind",
        "cardamom",
        "hyacinth",
        "malachite",
        "vermilion",
        "chamomile",
        "bergamot",
        "azalea",
        "gardenia",
    ),
    haystacks=("noise", "sentences", "stdlib-docs", "stdlib-code"),
)

TRAIN = Split(
    name="train",
    families=(
        TemplateFamily(  # the kv documents of gptoss_lite.train.data
            name="code",
            intro="",
            needle=" The code for {label} is {value}.",
            ask="\nWhat is the code for {label}?",
            hint=" If there is no code, answer none.",
            cue=" The code for {label} is",
            ask_all="\nWhat are the codes for {label}?",
            cue_all=" The codes for {label} are",
            ask_each="\nWhat are the codes for {labels}?",
            cue_each=" The codes are",
            assign=" Set {name} to {value}.",
            link=" Set {name} to {other}.",
            chain_ask="\nWhich variables hold {value}?",
            chain_cue=" The variables holding {value} are",
        ),
        TemplateFamily(
            name="secret",
            intro="",
            needle=" The secret value of {label} is {value}.",
            ask="\nWhat is the secret value of {label}?",
            hint=" Answer none if it was not given.",
            cue=" The secret value of {label} is",
            ask_all="\nWhat are all the secret values of {label}?",
            cue_all=" The secret values of {label} are",
            ask_each="\nWhat are the secret values of {labels}?",
            cue_each=" In order, the secret values are",
            assign=" Put {value} into {name}.",
            link=" Put the contents of {other} into {name}.",
            chain_ask="\nWhich boxes contain {value}?",
            chain_cue=" The boxes containing {value} are",
        ),
        TemplateFamily(
            name="memo",
            intro="Read the memo and answer the question.\n",
            needle=" Memo: {label} holds {value}.",
            ask="\nWhat does {label} hold?",
            hint=" Reply none if the memo does not say.",
            cue=" It holds",
            ask_all="\nWhat does {label} hold, in every memo?",
            cue_all=" In every memo it holds",
            ask_each="\nWhat do {labels} hold?",
            cue_each=" They hold, in order,",
            assign=" Memo: {name} copies {value}.",
            link=" Memo: {name} copies {other}.",
            chain_ask="\nWhich names copy {value}?",
            chain_cue=" Names copying {value}:",
        ),
    ),
    labels=(
        "anvil",
        "barge",
        "chisel",
        "drawbridge",
        "easel",
        "ferryman",
        "granary",
        "hourglass",
        "inkwell",
        "jetty",
        "kiln",
        "loom",
        "mast",
        "nutmeg",
        "oar",
        "parchment",
        "quiver",
        "rudder",
        "satchel",
        "tinderbox",
        "vault",
        "wharf",
    ),
    words=(
        "auburn",
        "cedar",
        "coral",
        "ember",
        "flint",
        "hazel",
        "indigo",
        "ivory",
        "jade",
        "lichen",
        "maple",
        "ochre",
        "pewter",
        "quartz",
        "russet",
        "slate",
        "teal",
        "umber",
    ),
    haystacks=("procedural", "varied", "train-code", "echo"),
)

SPLITS: dict[str, Split] = {"train": TRAIN, "eval": EVAL}


def get_split(name: str) -> Split:
    """The split called `name` (`train` or `eval`)."""
    if name not in SPLITS:
        raise ValueError(f"split={name!r}: must be one of {SPLIT_NAMES}")
    return SPLITS[name]
