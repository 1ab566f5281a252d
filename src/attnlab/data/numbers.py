"""An English -> German parallel corpus that attnlab generates from a small grammar.

No download and no data file: sentences are drawn from a grammar written below, so the
corpus is the same on every machine for a given seed. It is named for its number words,
whose German order is reversed, but it exercises the other classic reorderings too, which
makes cross-attention plots worth looking at.

The German rules the grammar encodes (every source has exactly one translation):

- Numbers put the ones before the tens, joined by "und": forty-seven -> siebenundvierzig,
  twenty-one -> einundzwanzig (1 is "ein" inside a compound, "eins" alone).
- Nouns have a gender (der Hund, die Katze, das Kind) and are capitalised. The article and
  an adjective agree with the noun in gender, number and case:
  nominative (subject), accusative (object of most verbs; after "für", "ohne") and dative
  (indirect object; object of "folgen", "helfen"; after "mit", "von").
  After der/die/das the adjective ends in -e or -en ("den großen Hund"); after ein it shows
  the gender itself ("ein großer Hund", "ein großes Kind"); with no article (a count) it
  ends in -e, or -en in the dative. Dative plural nouns add -n unless they end in -n or -s.
- The verb agrees with its subject: der Hund sieht, die Hunde sehen.
- Verb second: when something else comes first (an adverb, a subordinate clause), the verb
  comes before the subject: "heute sieht der Hund die Katze".
- Verb last: in a clause opened by weil, wenn, obwohl, dass the verb goes to the end:
  "..., weil der Hund die Katze sieht". German puts a comma before such a clause.

Text is lower-case except German nouns; punctuation is a separate word ("schläft , weil"),
as in tokenized machine-translation data.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

Pair = tuple[str, str]

_EN_ONES = "- one two three four five six seven eight nine".split()
_EN_TEENS = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_EN_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()
_DE_ONES = "- eins zwei drei vier fünf sechs sieben acht neun".split()
_DE_TEENS = "zehn elf zwölf dreizehn vierzehn fünfzehn sechzehn siebzehn achtzehn neunzehn".split()
_DE_TENS = "- - zwanzig dreißig vierzig fünfzig sechzig siebzig achtzig neunzig".split()


def english_number(n: int) -> str:
    """1..99 in English words: 47 -> "forty-seven"."""
    if not 1 <= n <= 99:
        raise ValueError(f"number words cover 1..99, got {n}")
    if n < 20:
        return _EN_ONES[n] if n < 10 else _EN_TEENS[n - 10]
    tens, ones = divmod(n, 10)
    return _EN_TENS[tens] + (f"-{_EN_ONES[ones]}" if ones else "")


def german_number(n: int) -> str:
    """1..99 in German words, ones before tens: 47 -> "siebenundvierzig"."""
    if not 1 <= n <= 99:
        raise ValueError(f"number words cover 1..99, got {n}")
    if n < 20:
        return _DE_ONES[n] if n < 10 else _DE_TEENS[n - 10]
    tens, ones = divmod(n, 10)
    if ones == 0:
        return _DE_TENS[tens]
    return ("ein" if ones == 1 else _DE_ONES[ones]) + "und" + _DE_TENS[tens]


class _Noun(NamedTuple):
    en: str
    en_pl: str
    de: str
    de_pl: str
    gender: str  # "m", "f" or "n"
    animate: bool


_NOUNS = {n.en: n for n in [
    _Noun("dog", "dogs", "Hund", "Hunde", "m", True),
    _Noun("man", "men", "Mann", "Männer", "m", True),
    _Noun("teacher", "teachers", "Lehrer", "Lehrer", "m", True),
    _Noun("bird", "birds", "Vogel", "Vögel", "m", True),
    _Noun("cat", "cats", "Katze", "Katzen", "f", True),
    _Noun("woman", "women", "Frau", "Frauen", "f", True),
    _Noun("child", "children", "Kind", "Kinder", "n", True),
    _Noun("girl", "girls", "Mädchen", "Mädchen", "n", True),
    _Noun("horse", "horses", "Pferd", "Pferde", "n", True),
    _Noun("ball", "balls", "Ball", "Bälle", "m", False),
    _Noun("apple", "apples", "Apfel", "Äpfel", "m", False),
    _Noun("flower", "flowers", "Blume", "Blumen", "f", False),
    _Noun("book", "books", "Buch", "Bücher", "n", False),
    _Noun("car", "cars", "Auto", "Autos", "n", False),
]}
_ANIMATE = [k for k, n in _NOUNS.items() if n.animate]
_THINGS = [k for k, n in _NOUNS.items() if not n.animate]
_ADJECTIVES = {"big": "groß", "small": "klein", "old": "alt", "black": "schwarz", "red": "rot"}
# case -> gender ("pl" for plural) -> article
_DEFINITE = {"nom": dict(m="der", f="die", n="das", pl="die"),
             "acc": dict(m="den", f="die", n="das", pl="die"),
             "dat": dict(m="dem", f="der", n="dem", pl="den")}
_INDEFINITE = {"nom": dict(m="ein", f="eine", n="ein"),
               "acc": dict(m="einen", f="eine", n="ein"),
               "dat": dict(m="einem", f="einer", n="einem")}
# English base form -> (English 3rd singular, German 3rd singular, German 3rd plural, object cases).
# Object cases are in German word order; "that" marks a verb taking a dass-clause.
_VERBS = {
    "see": ("sees", "sieht", "sehen", ("acc",)),
    "like": ("likes", "mag", "mögen", ("acc",)),
    "find": ("finds", "findet", "finden", ("acc",)),
    "hear": ("hears", "hört", "hören", ("acc",)),
    "follow": ("follows", "folgt", "folgen", ("dat",)),
    "help": ("helps", "hilft", "helfen", ("dat",)),
    "give": ("gives", "gibt", "geben", ("dat", "acc")),
    "show": ("shows", "zeigt", "zeigen", ("dat", "acc")),
    "sleep": ("sleeps", "schläft", "schlafen", ()),
    "run": ("runs", "läuft", "laufen", ()),
    "wait": ("waits", "wartet", "warten", ()),
    "say": ("says", "sagt", "sagen", "that"),
    "think": ("thinks", "denkt", "denken", "that"),
}
_PREPOSITIONS = {"with": ("mit", "dat"), "from": ("von", "dat"), "for": ("für", "acc"), "without": ("ohne", "acc")}
_ADVERBS = {"today": "heute", "now": "jetzt", "often": "oft", "sometimes": "manchmal", "here": "hier"}
_CONJUNCTIONS = {"because": "weil", "when": "wenn", "although": "obwohl"}


def _adjective_ending(declension: str, case: str, gender: str) -> str:
    """Ending after der-words ("weak"), after ein-words ("mixed") or with no article ("strong")."""
    if case == "dat":
        return "en"
    if declension == "weak":
        return "e" if case == "nom" and gender != "pl" or gender in ("f", "n") else "en"
    if declension == "mixed":
        return {"m": "er" if case == "nom" else "en", "f": "e", "n": "es"}[gender]
    return "e"  # strong, plural only here


@dataclass(frozen=True)
class NP:
    """A noun phrase: ``det`` is "the", "a", "one" or a count 2..99; ``plural`` only with "the"."""
    noun: str
    det: str | int = "the"
    adj: str | None = None
    plural: bool = False

    def __post_init__(self):
        if self.noun not in _NOUNS or (self.adj is not None and self.adj not in _ADJECTIVES):
            raise ValueError(f"unknown noun or adjective in {self}")
        det_ok = 2 <= self.det <= 99 if isinstance(self.det, int) else self.det in ("the", "a", "one")
        if not det_ok or self.plural and self.det != "the":
            raise ValueError(f"bad determiner in {self}")

    @property
    def is_plural(self) -> bool:
        return self.plural or isinstance(self.det, int)

    def english(self) -> str:
        noun = _NOUNS[self.noun]
        words = ([self.adj] if self.adj else []) + [noun.en_pl if self.is_plural else noun.en]
        if isinstance(self.det, int):
            det = english_number(self.det)
        elif self.det == "a" and words[0][0] in "aeiou":
            det = "an"
        else:
            det = self.det
        return " ".join([det, *words])

    def german(self, case: str) -> str:
        noun = _NOUNS[self.noun]
        gender = "pl" if self.is_plural else noun.gender
        if isinstance(self.det, int):
            article, declension = german_number(self.det), "strong"
        elif self.det == "the":
            article, declension = _DEFINITE[case][gender], "weak"
        else:  # "a" and "one" are both "ein", declined like the indefinite article
            article, declension = _INDEFINITE[case][gender], "mixed"
        word = noun.de_pl if self.is_plural else noun.de
        if self.is_plural and case == "dat" and not word.endswith(("n", "s")):
            word += "n"
        adj = [_ADJECTIVES[self.adj] + _adjective_ending(declension, case, gender)] if self.adj else []
        return " ".join([article, *adj, word])


@dataclass(frozen=True)
class Clause:
    """Subject, verb (English base form), objects, an optional (preposition, NP) and dass-clause."""
    subject: NP
    verb: str
    objects: tuple[NP, ...] = ()
    pp: tuple[str, NP] | None = None
    that: Clause | None = None

    def __post_init__(self):
        cases = _VERBS[self.verb][3]
        if (cases == "that") != (self.that is not None) or cases != "that" and len(cases) != len(self.objects):
            raise ValueError(f"{self.verb!r} does not take these objects: {self}")

    def english(self) -> str:
        verb = self.verb if self.subject.is_plural else _VERBS[self.verb][0]
        words = [self.subject.english(), verb, *(o.english() for o in self.objects)]
        if self.pp:
            words += [self.pp[0], self.pp[1].english()]
        if self.that:
            words += ["that", self.that.english()]
        return " ".join(words)

    def german(self, order: str = "main") -> str:
        """order: "main" subject-verb-rest, "v2" verb-subject-rest, "sub" subject-rest-verb."""
        _, sing, plur, cases = _VERBS[self.verb]
        verb, subject = (plur if self.subject.is_plural else sing), self.subject.german("nom")
        rest = [o.german(c) for o, c in zip(self.objects, cases)] if cases != "that" else []
        if self.pp:
            prep, case = _PREPOSITIONS[self.pp[0]]
            rest.append(f"{prep} {self.pp[1].german(case)}")
        words = {"main": [subject, verb, *rest], "v2": [verb, subject, *rest], "sub": [subject, *rest, verb]}[order]
        if self.that:  # the dass-clause follows the verb even in a verb-last clause
            words += [",", "dass", self.that.german("sub")]
        return " ".join(words)


def _random_np(rng: random.Random, nouns: list[str]) -> NP:
    noun, adj = rng.choice(nouns), rng.choice(list(_ADJECTIVES)) if rng.random() < 0.3 else None
    r = rng.random()
    if r < 0.25:
        return NP(noun, rng.randint(2, 99), adj)
    det = "the" if r < 0.75 else "a" if r < 0.95 else "one"
    return NP(noun, det, adj, plural=det == "the" and r < 0.4)


def _random_clause(rng: random.Random, pp_prob: float, allow_that: bool, subject: NP | None = None) -> Clause:
    verbs = [v for v in _VERBS if allow_that or _VERBS[v][3] != "that"]
    verb = rng.choice(verbs)
    cases = _VERBS[verb][3]
    if cases == "that":
        return Clause(subject or _random_np(rng, _ANIMATE), verb, that=_random_clause(rng, 0.0, allow_that=False))
    # a dative object is a person or animal; the thing given or shown is a thing
    objects = tuple(_random_np(rng, _ANIMATE if c == "dat" else _THINGS if len(cases) == 2 else list(_NOUNS))
                    for c in cases)
    pp = (rng.choice(list(_PREPOSITIONS)), _random_np(rng, _ANIMATE)) if rng.random() < pp_prob else None
    return Clause(subject or _random_np(rng, _ANIMATE), verb, objects, pp)


def random_pair(rng: random.Random) -> Pair:
    """One (English, German) sentence pair drawn from the grammar."""
    kind = rng.choices(["main", "adverb", "sub_after", "sub_first"], weights=[3, 2, 3, 2])[0]
    if kind == "main":
        c = _random_clause(rng, 0.3, allow_that=True)
        return c.english(), c.german("main")
    if kind == "adverb":
        adv, c = rng.choice(list(_ADVERBS)), _random_clause(rng, 0.3, allow_that=True)
        return f"{adv} {c.english()}", f"{_ADVERBS[adv]} {c.german('v2')}"
    conj = rng.choice(list(_CONJUNCTIONS))
    main, sub = _random_clause(rng, 0.1, allow_that=False), _random_clause(rng, 0.1, allow_that=False)
    if kind == "sub_after":
        return (f"{main.english()} {conj} {sub.english()}",
                f"{main.german('main')} , {_CONJUNCTIONS[conj]} {sub.german('sub')}")
    return (f"{conj} {sub.english()} , {main.english()}",
            f"{_CONJUNCTIONS[conj]} {sub.german('sub')} , {main.german('v2')}")


class Splits(NamedTuple):
    """Train/valid/test lists of (source, target) pairs; unpacks as ``train, valid, test``."""
    train: list[Pair]
    valid: list[Pair]
    test: list[Pair]


def number_corpus(n_train: int = 20000, n_valid: int = 500, n_test: int = 500, seed: int = 0,
                  max_words: int = 20) -> Splits:
    """Generate the English -> German corpus: deterministic for a seed, splits disjoint by source.

    Pairs are drawn in order and a repeated source is dropped; the first ``n_test`` distinct
    pairs are the test set, the next ``n_valid`` the validation set, the rest training. So
    the test set does not change when only ``n_train`` changes. Sentences have 3 to
    ``max_words`` words on both sides.
    """
    if min(n_train, n_valid, n_test) < 0 or max_words < 3:
        raise ValueError("split sizes must be >= 0 and max_words >= 3")
    total, rng = n_train + n_valid + n_test, random.Random(seed)
    seen: set[str] = set()
    pairs: list[Pair] = []
    for _ in range(50 * total + 1000):
        if len(pairs) == total:
            break
        src, tgt = random_pair(rng)
        if src not in seen and len(src.split()) <= max_words and len(tgt.split()) <= max_words:
            seen.add(src)
            pairs.append((src, tgt))
    else:
        if len(pairs) < total:
            raise ValueError(f"the grammar gave only {len(pairs)} distinct sentences of <= {max_words} words")
    return Splits(pairs[n_test + n_valid:], pairs[n_test:n_test + n_valid], pairs[:n_test])


def english_documents(n_documents: int = 2000, seed: int = 0, sentences: tuple[int, int] = (4, 8)) -> list[list[str]]:
    """English documents drawn from the same grammar, for masked-LM pre-training (``attnlab train
    mlm`` without ``--data``): each document follows one protagonist ("the old dog", "the
    women") through ``sentences`` (min, max) sentences, each a clause with that subject, some
    opened by an adverb. Consecutive sentences therefore share their subject while two random
    sentences rarely do, so next-sentence prediction has a signal to learn, and the masked
    words are predictable from their context (agreement "the dog sees" / "the dogs see",
    objects of "give" are things, numbers are spelled out). Deterministic for a seed."""
    if n_documents < 0 or not 1 <= sentences[0] <= sentences[1]:
        raise ValueError("english_documents: n_documents must be >= 0 and 1 <= sentences[0] <= sentences[1]")
    rng = random.Random(seed)
    documents = []
    for _ in range(n_documents):
        noun, adj = rng.choice(_ANIMATE), rng.choice(list(_ADJECTIVES)) if rng.random() < 0.5 else None
        protagonist = NP(noun, "the", adj, plural=rng.random() < 0.3)
        lines = []
        for _ in range(rng.randint(*sentences)):
            clause = _random_clause(rng, 0.3, allow_that=True, subject=protagonist).english()
            lines.append(f"{rng.choice(list(_ADVERBS))} {clause}" if rng.random() < 0.25 else clause)
        documents.append(lines)
    return documents
