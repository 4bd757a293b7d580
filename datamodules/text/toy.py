"""The embedded toy English -> German corpus: a small grammar with gender, case and number agreement
(der/den/dem, ein/einen/einem, adjective endings), plural verbs, and verb-second word order when a
place comes first ("In the park, a dog sleeps." -> "Im Park schläft ein Hund."). Deterministic,
about 100 words per language, learnable to BLEU ~100 by a tiny model in seconds. `write_toy_corpus`
writes it in the Multi30k layout that `datamodules.text.ParallelTextDataModule` reads.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

_ANIMATE = [  # English singular, plural; German singular, plural, gender
    ("man", "men", "Mann", "Männer", "m"),
    ("woman", "women", "Frau", "Frauen", "f"),
    ("child", "children", "Kind", "Kinder", "n"),
    ("dog", "dogs", "Hund", "Hunde", "m"),
    ("cat", "cats", "Katze", "Katzen", "f"),
    ("girl", "girls", "Mädchen", "Mädchen", "n"),
    ("boy", "boys", "Junge", "Jungen", "m"),
    ("bird", "birds", "Vogel", "Vögel", "m"),
]
_THINGS = [
    ("ball", "balls", "Ball", "Bälle", "m"),
    ("bike", "bikes", "Fahrrad", "Fahrräder", "n"),
    ("car", "cars", "Auto", "Autos", "n"),
    ("book", "books", "Buch", "Bücher", "n"),
    ("apple", "apples", "Apfel", "Äpfel", "m"),
    ("flower", "flowers", "Blume", "Blumen", "f"),
    ("hat", "hats", "Hut", "Hüte", "m"),
    ("cup", "cups", "Tasse", "Tassen", "f"),
]
_PLACES = [
    ("park", "Park", "m"),
    ("street", "Straße", "f"),
    ("house", "Haus", "n"),
    ("garden", "Garten", "m"),
    ("beach", "Strand", "m"),
    ("city", "Stadt", "f"),
    ("field", "Feld", "n"),
    ("lake", "See", "m"),
]
_PREPOSITIONS = [("in", "in"), ("on", "auf"), ("behind", "hinter"), ("in front of", "vor"), ("next to", "neben")]
_ADJECTIVES = [
    ("red", "rot"),
    ("big", "groß"),
    ("small", "klein"),
    ("old", "alt"),
    ("young", "jung"),
    ("black", "schwarz"),
    ("white", "weiß"),
    ("happy", "glücklich"),
    ("blue", "blau"),
    ("green", "grün"),
]
_TRANSITIVE = [
    ("sees", "see", "sieht", "sehen"),
    ("holds", "hold", "hält", "halten"),
    ("carries", "carry", "trägt", "tragen"),
    ("throws", "throw", "wirft", "werfen"),
    ("finds", "find", "findet", "finden"),
    ("buys", "buy", "kauft", "kaufen"),
    ("watches", "watch", "beobachtet", "beobachten"),
    ("paints", "paint", "malt", "malen"),
]
_INTRANSITIVE = [
    ("sits", "sit", "sitzt", "sitzen"),
    ("stands", "stand", "steht", "stehen"),
    ("plays", "play", "spielt", "spielen"),
    ("sleeps", "sleep", "schläft", "schlafen"),
    ("waits", "wait", "wartet", "warten"),
    ("runs", "run", "läuft", "laufen"),
]
_DEFINITE = {
    "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
}
_INDEFINITE = {
    "nom": {"m": "ein", "f": "eine", "n": "ein"},
    "acc": {"m": "einen", "f": "eine", "n": "ein"},
    "dat": {"m": "einem", "f": "einer", "n": "einem"},
}
_ENDING_AFTER_DEFINITE = {"nom": {"m": "e", "f": "e", "n": "e"}, "acc": {"m": "en", "f": "e", "n": "e"}}
_ENDING_AFTER_INDEFINITE = {"nom": {"m": "er", "f": "e", "n": "es"}, "acc": {"m": "en", "f": "e", "n": "es"}}


def _noun_phrase(rng: random.Random, noun: tuple, case: str) -> tuple[str, str, bool]:
    """(English, German, plural) for a determiner, an optional adjective and ``noun`` in ``case``."""
    en_sg, en_pl, de_sg, de_pl, gender = noun
    det = rng.choice(["a", "the", "the", "two", "three"])
    plural = det in ("two", "three") or (det == "the" and rng.random() < 0.3)
    adj = rng.choice(_ADJECTIVES) if rng.random() < 0.4 else None
    g = "pl" if plural else gender
    if det in ("two", "three"):  # no article: strong adjective ending
        de_det, ending = {"two": "zwei", "three": "drei"}[det], "en" if case == "dat" else "e"
    elif det == "the":
        de_det = _DEFINITE[case][g]
        ending = "en" if plural or case == "dat" else _ENDING_AFTER_DEFINITE[case][g]
    else:
        de_det = _INDEFINITE[case][g]
        ending = "en" if case == "dat" else _ENDING_AFTER_INDEFINITE[case][g]
    de_noun = de_pl if plural else de_sg
    if plural and case == "dat" and not de_noun.endswith(("n", "s")):
        de_noun += "n"  # dative plural: den Hunden, zwei Bällen
    words = ([adj[0]] if adj else []) + [en_pl if plural else en_sg]
    en = " ".join(["an" if det == "a" and words[0][0] in "aeiou" else det] + words)
    de = " ".join([de_det] + ([adj[1] + ending] if adj else []) + [de_noun])
    return en, de, plural


def _place(rng: random.Random) -> tuple[str, str]:
    en_prep, de_prep = rng.choice(_PREPOSITIONS)
    en_noun, de_noun, gender = rng.choice(_PLACES)
    article = _DEFINITE["dat"][gender]
    de = f"im {de_noun}" if de_prep == "in" and article == "dem" else f"{de_prep} {article} {de_noun}"
    return f"{en_prep} the {en_noun}", de


def toy_translation_pair(rng: random.Random) -> tuple[str, str]:
    """One English sentence and its German translation from the toy grammar."""
    subj_en, subj_de, plural = _noun_phrase(rng, rng.choice(_ANIMATE), "nom")
    if rng.random() < 0.5:
        verb = rng.choice(_TRANSITIVE)
        obj_en, obj_de, _ = _noun_phrase(rng, rng.choice(_THINGS + _ANIMATE), "acc")
    else:
        verb, obj_en, obj_de = rng.choice(_INTRANSITIVE), "", ""
    verb_en, verb_de = (verb[1], verb[3]) if plural else (verb[0], verb[2])
    place = _place(rng) if not obj_en or rng.random() < 0.5 else None
    if place and rng.random() < 0.4:  # place first: German puts the verb second, before the subject
        en = f"{place[0]}, {subj_en} {verb_en} {obj_en}".strip()
        de = f"{place[1]} {verb_de} {subj_de} {obj_de}".strip()
    else:
        en = " ".join(x for x in (subj_en, verb_en, obj_en, place[0] if place else "") if x)
        de = " ".join(x for x in (subj_de, verb_de, obj_de, place[1] if place else "") if x)
    return en[0].upper() + en[1:] + ".", de[0].upper() + de[1:] + "."


def toy_translation_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct sentence pairs from the toy grammar, deterministic given ``seed``."""
    rng, pairs = random.Random(seed), {}
    while len(pairs) < n:
        en, de = toy_translation_pair(rng)
        pairs.setdefault(en, de)
    return list(pairs.items())


TOY_SPLITS = {"train": 3000, "val": 300, "test": 300}


def write_toy_corpus(folder: str | Path) -> Path:
    """Write the toy corpus as ``{train,val,test}.{en,de}`` into ``folder`` once; return the folder."""
    folder = Path(folder)
    if all((folder / f"{s}.{l}").is_file() for s in TOY_SPLITS for l in ("en", "de")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    pairs = toy_translation_pairs(sum(TOY_SPLITS.values()))
    start = 0
    for split, size in TOY_SPLITS.items():  # distinct sentences, so no val/test sentence is in train
        for lang, side in (("en", 0), ("de", 1)):
            # a temporary file of this call's own, renamed into place: processes that write the corpus at once (the
            # ranks of a torchrun launch) never read half a file, and never rename each other's file away
            fd, tmp = tempfile.mkstemp(prefix=f".{split}.{lang}.", suffix=".tmp", dir=folder)
            with open(fd, "w", encoding="utf-8") as out:
                out.write("".join(p[side] + "\n" for p in pairs[start : start + size]))
            os.replace(tmp, folder / f"{split}.{lang}")
        start += size
    return folder
