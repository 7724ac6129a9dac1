"""Haystack filler: the text around needles in training documents and in some evaluation haystacks,
generated on the fly (a leaf module: the standard library only, so `train` and `evals` both use it).

Two generators, chosen by `data.filler`:

- `procedural` (stage 1 of the CPU demo): subject-verb-object sentences from a small word bank.
- `varied`: many sentence shapes over a word bank about ten times larger, made-up words, word
  salad, one- and two-word fragments, commas, exclamations, semicolons, quoted speech and the odd
  line break. A model trained only on `procedural` filler retrieves a passkey hidden in that filler
  at 16x its training length but fails on the evaluator's unseen sentences (it answers with
  letters), so retrieval has to be taught over a broad haystack distribution, not one style.

Both are digit-free (the only digits in a document are the needles and answers) and neither contains
the evaluator's sentences (`gptoss_lite.evals.passkey.FILLER_SENTENCES`; a test checks): words may
coincide, as common English words do, but the evaluation haystack is never trained on.
"""

from __future__ import annotations

import random

FILLERS = ("procedural", "varied")

# ---- procedural (small bank; stage 1) -----------------------------------------------------------
ADJ = (
    "quiet",
    "copper",
    "narrow",
    "patient",
    "crooked",
    "silver",
    "hollow",
    "gentle",
    "rusty",
    "bright",
    "distant",
    "heavy",
    "tiny",
    "ancient",
    "restless",
    "woolen",
    "salty",
    "frozen",
)
NOUN = (
    "fisherman",
    "weaver",
    "lantern",
    "goat",
    "carpenter",
    "violin",
    "merchant",
    "kettle",
    "sailor",
    "beetle",
    "potter",
    "orchard",
    "miller",
    "compass",
    "shepherd",
    "ladder",
    "owl",
    "blacksmith",
    "wagon",
    "falcon",
)
_VERB = (
    "carried",
    "painted",
    "followed",
    "repaired",
    "counted",
    "admired",
    "buried",
    "polished",
    "traded",
    "watched",
    "dropped",
    "mended",
    "chased",
    "sketched",
    "weighed",
)
_PLACE = (
    "the harbor",
    "the mill",
    "a muddy lane",
    "the market square",
    "the old bridge",
    "a windy hill",
    "the cellar",
    "the riverbank",
    "the workshop",
    "a pine forest",
    "the village well",
    "the lighthouse",
)
_PREP = ("near", "behind", "beyond", "inside", "across", "under", "beside")
_TIME = (
    "At dawn",
    "Later that week",
    "Every winter",
    "Before supper",
    "Long ago",
    "By noon",
    "After the storm",
    "One evening",
)
SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "vos", "sha", "pel", "dri", "qua", "zor", "ne", "fi")


def procedural_sentence(rng: random.Random) -> str:
    """One digit-free procedural filler sentence with a leading space."""
    form = rng.randrange(3)
    a, b = rng.sample(NOUN, 2)
    if form == 0:
        return f" The {rng.choice(ADJ)} {a} {rng.choice(_VERB)} the {b} {rng.choice(_PREP)} {rng.choice(_PLACE)}."
    if form == 1:
        return f" {rng.choice(_TIME)}, a {rng.choice(ADJ)} {a} {rng.choice(_VERB)} a {rng.choice(ADJ)} {b}."
    return f" Nobody {rng.choice(_VERB)} the {a} {rng.choice(_PREP)} {rng.choice(_PLACE)}, said the {b}."


# ---- varied (large bank) ------------------------------------------------------------------------
_V_NOUNS = tuple(
    """
apple anchor attic badger balcony banner barrel basket beacon beard bell bicycle blanket boat bone
bottle boulder bowl branch brick bucket cabin cable camel candle canoe canyon captain carpet castle
cave cellar chain chalk chapel cheese chimney circus cliff cloak clover coat comet cookie corner
cottage cousin crane crater crow crown cup curtain daisy desert diary doctor donkey door dragon
drawer drum eagle elbow engine envelope factory feather fence ferry field fig finger flag flame
flute forest fountain fox frog garage garden gate ghost giant glacier glove grape guitar hammer
harp hat hawk helmet hill hive horse hotel island jacket jar jungle key kitchen kite knight ladle
lake lamp leaf lemon library lizard lobster magnet mango marble meadow mirror monk moon moth mouse
mule museum needle nest novel oak ocean onion otter oven owl paddle palace parrot path pebble
pencil pepper piano pier pigeon pillow pilot pirate planet plum pond poet porch potato puppet
quilt rabbit raft rainbow raven ribbon ring river robot rocket roof rope rose saddle sail sandal
scarf school shadow shell ship shovel singer skull sled slipper snail soldier spider spoon stable
stair statue stove street sugar swan sword table tailor teacher tent thimble thread tiger toad
tower tractor tree trumpet tulip tunnel turtle umbrella valley vase village wallet walrus wheel
whistle widow window wizard wolf wren yard zebra
""".split()
)
_V_VERBS = tuple(
    """
admired argued baked borrowed bounced buried carved chased cleaned climbed collected covered crossed
dragged drew dropped dug earned emptied entered fetched filled fixed folded followed found gathered
grabbed greeted guarded hid hugged hunted ignored inspected juggled kicked kissed knitted lifted
lit loaded locked lost measured melted mended missed moved noticed opened ordered packed painted
passed picked planted polished pulled pushed questioned raised reached read rescued returned rolled
sailed scrubbed searched sewed shared shook signed sketched sold sorted spilled squeezed stacked
stirred stole studied swept tasted threw tied tossed touched traced trimmed tugged turned unpacked
visited wandered warmed washed watched weighed whistled wiped wrapped wrote
""".split()
)
_V_INTRANSITIVE = tuple(
    """
arrived blinked coughed danced drifted faded fell flickered floated froze glowed grew hesitated
howled hummed laughed leaned listened melted nodded paused rang rested roared rose rusted sang
shivered shrank sighed slept slipped smiled sneezed spun stopped stumbled swayed trembled vanished
waited walked wept whispered wobbled yawned
""".split()
)
_V_ADJS = tuple(
    """
amber awkward bitter blue bold brave brittle broken busy calm careful cheerful chilly clever cloudy
clumsy crimson curious damp dark dear dim dizzy dry dusty eager early empty faint fancy fierce
foggy fragile fresh friendly gloomy golden grand green grumpy hasty honest huge humble icy idle
jolly kind large lazy little lively lonely loud lucky mild misty modest muddy nervous noble odd
old orange pale plain polite proud purple rapid rare rough royal rusty sandy scarlet shabby shiny
shy silent simple sleepy slow smoky soft sour spare steep sticky stormy strange strict sunny sweet
swift tall tame tender thick thin tidy tired twisted velvet violet warm weary wet wicked wild
windy wise wooden young
""".split()
)
_V_ADVERBS = tuple(
    """
slowly quickly quietly loudly gently suddenly carefully happily sadly bravely calmly eagerly rarely
often never always soon later again twice nearly almost barely simply softly boldly
""".split()
)
_V_PREPS = (
    "near",
    "behind",
    "beyond",
    "inside",
    "across",
    "under",
    "beside",
    "above",
    "below",
    "around",
    "through",
    "past",
    "toward",
    "against",
    "along",
    "between",
    "over",
    "into",
)
_V_NAMES = tuple(
    """
Ada Boris Clara Dmitri Elena Farid Greta Hugo Ines Jonas Keiko Leon Mira Nadia Oskar Priya Quentin
Rosa Sven Tamsin Umar Vera Wendel Xenia Yusuf Zora
""".split()
)
_V_OPENERS = (
    "Then",
    "Meanwhile",
    "Still",
    "Afterwards",
    "Of course",
    "Perhaps",
    "Suddenly",
    "Later",
    "Once",
    "Sometimes",
    "At last",
    "In the morning",
    "By evening",
    "That night",
    "For a while",
    "Without a word",
    "Every spring",
    "Even so",
    "Outside",
    "Far away",
)
_V_CONJ = ("and", "but", "so", "while", "because", "although", "until", "before", "after", "when")
_V_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _noun_phrase(rng: random.Random) -> str:
    det = rng.choice(("the", "the", "a", "my", "her", "his", "their", "every", "one", "that", "some"))
    if det == "a" and rng.random() < 0.5:
        det = "the"
    adjs = " ".join(rng.sample(_V_ADJS, rng.choice((0, 0, 1, 1, 2))))
    noun = rng.choice(_V_NOUNS)
    phrase = f"{det} {adjs} {noun}" if adjs else f"{det} {noun}"
    if det == "a" and phrase[2] in "aeiou":
        phrase = "an" + phrase[1:]
    return phrase


def _subject(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.25:
        return rng.choice(_V_NAMES)
    if r < 0.35:
        return rng.choice(("she", "he", "they", "we", "nobody", "everyone", "someone"))
    return _noun_phrase(rng)


def _clause(rng: random.Random) -> str:
    subject = _subject(rng)
    if rng.random() < 0.4:
        verb = rng.choice(_V_INTRANSITIVE)
        tail = rng.choice(("", f" {rng.choice(_V_ADVERBS)}", f" {rng.choice(_V_PREPS)} {_noun_phrase(rng)}"))
        return f"{subject} {verb}{tail}"
    verb = rng.choice(_V_VERBS)
    obj = _noun_phrase(rng)
    tail = rng.choice(("", "", f" {rng.choice(_V_PREPS)} {_noun_phrase(rng)}", f" {rng.choice(_V_ADVERBS)}"))
    return f"{subject} {verb} {obj}{tail}"


def _pseudo_word(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
    return "".join(rng.choice(_V_LETTERS) for _ in range(rng.randint(2, 9)))


def _salad(rng: random.Random) -> str:
    pools = (_V_NOUNS, _V_VERBS, _V_ADJS, _V_ADVERBS, _V_PREPS, _V_INTRANSITIVE)
    words = []
    for _ in range(rng.randint(2, 14)):
        words.append(_pseudo_word(rng) if rng.random() < 0.2 else rng.choice(rng.choice(pools)))
    return " ".join(words)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def varied_sentence(rng: random.Random) -> str:
    """One digit-free filler sentence of a random shape, with a leading space (or a line break)."""
    r = rng.random()
    if r < 0.14:  # fragments: 'Ink.', 'Dusk came.', 'Cold wind.'
        shape = rng.randrange(4)
        if shape == 0:
            body = rng.choice(_V_NOUNS)
        elif shape == 1:
            body = f"{rng.choice(_V_NOUNS)} {rng.choice(_V_INTRANSITIVE)}"
        elif shape == 2:
            body = f"{rng.choice(_V_ADJS)} {rng.choice(_V_NOUNS)}"
        else:
            body = f"{rng.choice(_V_NAMES)} {rng.choice(_V_INTRANSITIVE)}"
    elif r < 0.52:
        body = _clause(rng)
    elif r < 0.70:
        body = f"{_clause(rng)}, {rng.choice(_V_CONJ)} {_clause(rng)}"
    elif r < 0.80:
        body = f"{rng.choice(_V_OPENERS)}, {_clause(rng)}"
    elif r < 0.86:
        speaker = rng.choice(_V_NAMES)
        body = f'"{_cap(_clause(rng))}," said {speaker}'
    elif r < 0.95:
        body = _salad(rng)
    else:
        body = " ".join(_pseudo_word(rng) for _ in range(rng.randint(1, 8)))
    end = rng.choices((".", "!", ";", "...", "."), weights=(80, 6, 4, 3, 7))[0]
    text = _cap(body) + end
    if rng.random() < 0.03:
        text = text.upper() if rng.random() < 0.3 else text.lower()
    lead = "\n" if rng.random() < 0.04 else " "
    return lead + text


def sentence_generator(kind: str):
    """The sentence function of a filler kind (`FILLERS`)."""
    if kind == "procedural":
        return procedural_sentence
    if kind == "varied":
        return varied_sentence
    raise ValueError(f"data.filler={kind!r}: must be one of {FILLERS}")
