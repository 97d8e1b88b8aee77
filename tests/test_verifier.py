"""The quotation verifier, evidence-tag parsing and the format term f.

Expected values are written by hand: each adversarial quotation below is a copy that a reader can
see is, or is not, text from the conversation. The real MELD and CPED files supply conversations;
quotations are cut from them at run time and perturbed in ways that change their meaning."""

import csv
import random
import re
from collections import defaultdict

import pytest

from verifier import (
    ENGLISH_WORDS_FILE,
    english_words,
    extract_quotes,
    format_score,
    locate_quote,
    quotes_by_block,
    verify_quote,
    without_quotes,
)

ENGLISH = [
    "Hey, are you coming to Rachel's party on Saturday?",
    "I don't think I can make it to the party tonight, sorry.",
    "She told me the truth because she trusts me.",
    "I love him but I can't stay here anymore.",
    "I waited for 3 hours at the station and nobody came.",
    "We have three kids and a dog named Max.",
    "Well… I guess I'll never understand why he left.",
    "The meeting starts at 10:30 in room 204.",
]

CHINESE = [
    "你怎么还没来？我们都等了半天了。",
    "我今天不想去上班了，太累了。",
    "因为下雨，所以我们没有去公园。",
    "他说他三点到，可是现在已经五点了。",
    "你吃饭了吗？我给你留了一碗面。",
    "我刚才梦见你们堵门 管彭凯旋要红包",
]

JAPANESE = [
    "すみません、明日の会議には行けません。",
    "彼は昨日、三時に駅で待っていましたが、彼女は来ませんでした。",
    "私はコーヒーが好きですが、紅茶も飲みます。",
    "でも、それは君のせいじゃないよ。",
    "今日は本当にありがとうございました。",
]

PROMPT_TEXT = [
    "irritation, stress, displeasure, hostility or antagonism aimed at someone or something",
    "Turn to analyze",
    "Choose only from the following list of emotions",
    "[22 minutes later]",
    "Answer: Joy",
]


# (quotation, expected) against ENGLISH
ENGLISH_CASES = [
    # exact copies, with typographical variation that must pass
    ("I don't think I can make it to the party tonight", True),
    ("i DON'T think i can MAKE it", True),
    ("I don’t think I can make it", True),  # curly apostrophe
    ("“I don't think I can make it to the party,”", True),  # edge quotes and punctuation
    ("I  don't\tthink   I can make it", True),  # whitespace
    ("I dont think I can make it to the party", True),  # apostrophe dropped
    ("Ｉ ｄｏｎ'ｔ ｔｈｉｎｋ I can make it", True),  # full width
    ("I don't thnik I can make it to the party", True),  # transposition typo
    ("I don't think I can make it to the party tonihgt", True),
    ("I don't think I can mkae it to the party tonight", False),  # four-letter words take no typo
    ("She told me the trtuh because she trusts me", True),
    ("She told me the truth becuase she trusts me", False),  # protected words admit no typo
    ("I waited for 3 hours at the staton and nobody came", True),  # dropped letter
    ("Well... I guess I'll never understand why he left", True),  # ellipsis forms
    ("Well … I guess I'll never understand", True),
    ("I guess I'll never understand why he left", True),
    ("The meeting starts at 10:30 in room 204", True),
    # quotations across consecutive utterances
    ("on Saturday? I don't think I can make it", True),
    ("tonight, sorry. She told me the truth", True),
    # elisions: fragments in source order
    ("I don't think ... the party tonight", True),
    ("She told me the truth … she trusts me", True),
    ("I love him … anymore", False),  # a one-word fragment cannot carry evidence
    # negation dropped or added
    ("I do think I can make it to the party tonight", False),
    ("I don't think I can't make it to the party", False),
    ("I love him but I can stay here anymore", False),
    ("I guess I'll understand why he left", False),
    ("I waited for 3 hours at the station and somebody came", False),
    # pronoun swapped
    ("He told me the truth because she trusts me", False),
    ("She told you the truth because she trusts me", False),
    ("She told me the truth because she trusts him", False),
    ("I guess you'll never understand why he left", False),
    # conjunction swapped
    ("I love him and I can't stay here anymore", False),
    ("She told me the truth although she trusts me", False),
    ("I love him so I can't stay here anymore", False),
    # numeral changed, in any script
    ("I waited for 4 hours at the station and nobody came", False),
    ("I waited for 30 hours at the station and nobody came", False),
    ("I waited for ３ hours at the station", True),  # full-width digit, same number
    ("I waited for \u0663 hours at the station", True),  # Arabic-Indic three
    ("I waited for \u0664 hours at the station", False),  # Arabic-Indic four
    ("I waited for 三 hours at the station", False),
    ("We have four kids and a dog named Max", False),
    ("We have 3 kids and a dog named Max", False),
    ("The meeting starts at 10:45 in room 204", False),
    ("The meeting starts at 10:30 in room 205", False),
    # fragments reordered or overlapping
    ("the party tonight ... I don't think", False),
    ("I don't think I can ... I can make it", False),
    ("nobody came … I waited for 3 hours", False),
    # paraphrase and content-word swaps
    ("I won't be able to come to the party tonight", False),
    ("I don't believe I can make it to the party tonight", False),
    ("I love him but I can't remain here anymore", False),
    ("I hate him but I can't stay here anymore", False),
    ("I lose him but I can't stay here anymore", False),  # one letter, but a four-letter word
    (
        "I waited for 3 huors at the station and nobody came",
        True,
    ),  # a five-letter word may carry a typo
    ("She told me the lies because she trusts me", False),
    ("I don't think I can make it to the wedding tonight", False),
    # speaker names and time markers are not evidence
    ("Rachel: I don't think I can make it", False),
    ("Monica", False),
    ("[22 minutes later] I don't think I can make it", False),
    # empty or punctuation only
    ("", False),
    ("   ", False),
    ("...", False),
    ("?!", False),
    ("「」", False),
    # a cut inside a word is not a copy, nor one that leaves a negation behind
    ("ink I can make it", False),
    ("think I can make it to the party", False),
    ("understand why he left", False),
    ("came", False),
    ("I guess I'll", True),  # ending before a negation leaves no negated words behind
    ("I waited for 3 hours at the station and", True),
    ("Hey, are you coming", True),
]

# Near-miss "typos" that are really other words: an edit never turns one English word into another.
WORD_SWAP_SOURCE = [
    "What a lovely surprise, you remembered my birthday!",
    "We walked along the trail until the diner closed.",
    "The woman said she was quite sure about it.",
    "It was a casual remark, later forgotten by everyone.",
    "The conservation of the old building took years.",
    "I recieved your letter this morning.",  # the source's own misspelling
]

WORD_SWAP_CASES = [
    ("What a lovely surprise, you remembered my birthday", True),
    ("What a lonely surprise, you remembered my birthday", False),  # one letter, another word
    ("We walked along the trial until the diner closed", False),  # transposition, another word
    ("We walked along the trail until the dinner closed", False),  # doubled letter, another word
    ("The women said she was quite sure about it", False),
    ("The woman said she was quiet sure about it", False),
    ("It was a causal remark, later forgotten by everyone", False),
    ("It was a casual remark, latter forgotten by everyone", False),
    (
        "The conversation of the old building took years",
        False,
    ),  # two edits in a long word, another word
    # genuine misspellings keep their bounded tolerance
    ("What a lovley surprise, you remembered my birthday", True),
    ("We walked along the trail until the diner closd", True),
    ("The conservaiton of the old building took years", True),
    (
        "I received your letter this morning",
        True,
    ),  # the quote spells right what the source misspelled
]

CHINESE_CASES = [
    ("我今天不想去上班了", True),
    ("我今天不想去上班了，太累了", True),
    ("我今天不想去上班了 太累了", True),  # space for the comma
    ("我今天不想去上班了。。。太累了", True),
    ("我刚才梦见你们堵门，管彭凯旋要红包", True),
    ("我刚才梦见你们堵门管凯旋要红包", True),  # one character dropped from a 16-character quote
    ("我刚才梦见你们堵门管彭凯旋要红抱", False),  # a changed character is another word
    ("我们都等了半天了。我今天不想去上班了", True),  # across utterances
    ("你怎么还没来 … 都等了半天了", True),
    ("他说他３点到", False),  # the source writes 三
    ("他说他三点到，可是现在已经五点了", True),
    # negation dropped
    ("我今天想去上班了", False),
    ("想去上班了，太累了", False),  # cut right after the negation
    ("来？我们都等了半天了", False),
    ("怎么还", True),
    ("因为下雨，所以我们有去公园", False),
    ("你怎么还来", False),
    # pronoun swapped
    ("你今天不想去上班了", False),
    ("她说他三点到", False),
    ("我给他留了一碗面", False),
    # particle swapped or dropped
    ("你吃饭了呢", False),
    ("你吃饭吗", False),
    ("我今天不想去上班呢", False),
    # conjunction swapped
    ("虽然下雨，所以我们没有去公园", False),
    ("他说他三点到，而且现在已经五点了", False),
    # numeral changed
    ("他说他四点到，可是现在已经五点了", False),
    ("他说他三点到，可是现在已经六点了", False),
    ("我给你留了两碗面", False),
    # reordered, paraphrased, from the prompt
    ("太累了 … 我今天不想去上班了", False),
    ("我今天很累不想上班", False),
    ("今天太累了所以不去上班", False),
    ("愤怒：对某人或某事感到恼火", False),
]

JAPANESE_CASES = [
    ("明日の会議には行けません", True),
    ("すみません、明日の会議には行けません", True),
    ("すみません 明日の会議には行けません。", True),
    ("彼は昨日、三時に駅で待っていましたが", True),
    ("私はコーヒーが好きですが、紅茶も飲みます", True),
    ("私はｺｰﾋｰが好きですが", True),  # half-width katakana
    ("今日は本当にありがとございました", True),  # one character dropped from a long quote
    ("今日は本当にありがとうごさいました", False),  # a changed character is another word
    ("明日の会議には行けません。彼は昨日", True),  # across utterances
    # negation dropped
    ("明日の会議には行けます", False),
    ("彼女は来ました", False),
    ("それは君のせいだよ", False),
    ("明日の会議には行け", False),  # cut right before the negation
    ("明日の会議には行けま", False),  # cut inside it
    ("彼は昨日、三時に駅で待っていましたが、彼", False),  # cut inside 彼女
    # pronoun swapped
    ("彼女は昨日、三時に駅で待っていましたが", False),
    ("僕はコーヒーが好きですが", False),
    ("でも、それはあなたのせいじゃないよ", False),
    # particle swapped
    ("私がコーヒーが好きですが", False),
    ("私はコーヒーも好きですが", False),
    ("明日の会議では行けません", False),
    # conjunction swapped
    ("だから、それは君のせいじゃないよ", False),
    ("私はコーヒーが好きですし、紅茶も飲みます", False),
    # numeral changed
    ("彼は昨日、四時に駅で待っていましたが", False),
    ("彼は昨日、3時に駅で待っていましたが", False),
    # reordered, paraphrased
    ("紅茶も飲みます … 私はコーヒーが好き", False),
    ("私は紅茶よりコーヒーが好きです", False),
    ("明日のミーティングには参加できません", False),
]


@pytest.mark.parametrize("quote,expected", ENGLISH_CASES)
def test_english_adversarial(quote, expected):
    assert verify_quote(quote, ENGLISH) is expected


@pytest.mark.parametrize("quote,expected", WORD_SWAP_CASES)
def test_a_typo_never_turns_one_word_into_another(quote, expected):
    assert verify_quote(quote, WORD_SWAP_SOURCE) is expected


def test_the_english_word_list_is_sorted_lower_case_words():
    lines = [line.rstrip("\n") for line in ENGLISH_WORDS_FILE.open(encoding="utf-8")]
    words = [line for line in lines if not line.startswith("#")]
    # the licence
    assert "Kevin Atkinson" in "".join(lines[:20]) and "Permission to use" in "".join(lines[:40])
    assert words == sorted(set(words)) and all(re.fullmatch("[a-z]{4,}", w) for w in words)
    assert len(english_words()) == len(words) > 30000
    assert {
        "lovely",
        "lonely",
        "trail",
        "trial",
        "diner",
        "dinner",
        "hour",
        "hours",
    } <= english_words()
    assert not {"tonihgt", "recieved", "staton"} & english_words()


@pytest.mark.parametrize("quote,expected", CHINESE_CASES)
def test_chinese_adversarial(quote, expected):
    assert verify_quote(quote, CHINESE) is expected


@pytest.mark.parametrize("quote,expected", JAPANESE_CASES)
def test_japanese_adversarial(quote, expected):
    assert verify_quote(quote, JAPANESE) is expected


@pytest.mark.parametrize("quote", PROMPT_TEXT)
def test_prompt_text_is_not_evidence(quote):
    assert not verify_quote(quote, ENGLISH + CHINESE + JAPANESE)


def test_a_string_conversation_is_one_utterance():
    assert verify_quote("make it to the party", ENGLISH[1])
    assert not verify_quote("make it to the wedding", ENGLISH[1])


def test_locate_quote_names_the_matched_turns():
    assert locate_quote("I don't think I can make it", ENGLISH) == [1]
    assert locate_quote("on Saturday? I don't think", ENGLISH) == [0, 1]
    assert locate_quote(
        "sorry. She told me the truth because she trusts me. I love him", ENGLISH
    ) == [1, 2, 3]
    # the elided turn is not quoted
    assert locate_quote("Hey, are you coming … she trusts me", ENGLISH) == [0, 2]
    assert locate_quote("I do think I can make it", ENGLISH) == []
    assert locate_quote("我给你留了一碗面", CHINESE) == [4]


def test_a_quote_found_twice_is_located_at_its_first_occurrence():
    assert locate_quote(
        "see you tomorrow", ["ok", "see you tomorrow", "fine", "see you tomorrow"]
    ) == [1]


def test_fragments_may_not_overlap_even_when_each_matches():
    conversation = ["we can talk about it later tonight"]
    assert verify_quote("we can talk … about it later", conversation)
    assert not verify_quote("we can talk about … talk about it", conversation)
    assert verify_quote("we can talk about … talk about it", conversation + ["so talk about it"])


def test_exact_mode_allows_normalization_only():
    # case, apostrophe, spacing
    assert verify_quote("i DON\u2019T think  I can make it", ENGLISH, exact=True)
    # a contiguous run across turns
    assert verify_quote("on Saturday? I don't think", ENGLISH, exact=True)
    # a typo the default mode forgives ...
    assert verify_quote("I dont thnk I can make it", ENGLISH)
    # ... and exact mode does not
    assert not verify_quote("I dont thnk I can make it", ENGLISH, exact=True)
    assert verify_quote("Hey, are you coming … she trusts me", ENGLISH)
    # no joined fragments
    assert not verify_quote("Hey, are you coming … she trusts me", ENGLISH, exact=True)
    assert verify_quote("我们都等了半天了", CHINESE, exact=True) and verify_quote(
        "你怎么还没来？我们等了半天了", CHINESE
    )
    # a left-out character
    assert not verify_quote("你怎么还没来？我们等了半天了", CHINESE, exact=True)
    # a cut that drops the negation
    assert not verify_quote("know I can make it", ENGLISH, exact=True)


# ----------------------------------------------------------------------------- tags and f


def test_extract_quotes_reads_every_opener_closed_or_not():
    assert extract_quotes("no tags here") == []
    assert extract_quotes(
        "He says <evidence>I am fine</evidence>, then <evidence> go away </evidence>."
    ) == ["I am fine", "go away"]
    assert extract_quotes("<evidence>a <evidence>b</evidence></evidence>") == ["a", "b"]
    assert extract_quotes("She writes <evidence>I never said that") == ["I never said that"]
    assert extract_quotes("</evidence>stray<evidence></evidence>") == [""]


def test_without_quotes_keeps_only_the_writers_words():
    def words(text):
        return without_quotes(text).split()

    assert words(
        "He says <evidence>I am fine</evidence>, then <evidence> go away </evidence>."
    ) == ["He", "says", ",", "then", "."]
    # as extract_quotes reads it
    assert words("<evidence>a <evidence>b</evidence> c</evidence> d") == ["c", "d"]
    assert words("She writes <evidence>I never said that\n\nnew block") == ["She", "writes"]
    assert without_quotes("no tags") == "no tags"
    assert without_quotes("a<evidence>b</evidence>c") == "a  c"  # words on either side stay apart


@pytest.mark.parametrize(
    "text,expected",
    [
        ("no tags at all", 1.0),
        ("<evidence>a</evidence> and <evidence>b</evidence>", 1.0),
        ("<evidence>a</evidence> b</evidence>", 1 / 2),  # 1 closed / (1 open + 1 stray)
        (
            "<evidence>a <evidence>b</evidence></evidence>",
            1 / 3,
        ),  # nested: 1 closed / (2 open + 1 stray)
        ("<evidence>never closed", 0.0),
        ("</evidence>", 0.0),
        ("<evidence>a</evidence><evidence>b", 1 / 2),
        ("</evidence><evidence>a</evidence>", 1 / 2),
        ("<evidence>a</evidence></evidence></evidence>", 1 / 3),
    ],
)
def test_format_score(text, expected):
    assert format_score(text) == pytest.approx(expected)


def test_quotes_by_block():
    blocks = [
        "Rachel asks <evidence>are you coming to Rachel's party</evidence>.",
        "No quotes here.",
        "He says <evidence>I can make it</evidence> and <evidence>I can't stay</evidence>.",
    ]
    assert quotes_by_block(blocks, ENGLISH) == [
        [("are you coming to Rachel's party", True)],
        [],
        [("I can make it", True), ("I can't stay", True)],
    ]
    assert quotes_by_block(["<evidence>I can stay</evidence>"], ENGLISH) == [
        [("I can stay", False)]
    ]


# ----------------------------------------------------------------------------- real data

NEGATION_SWAPS = {
    "don't": "do",
    "can't": "can",
    "not ": "",
    "never ": "",
    "no ": "",
    "didn't": "did",
    "won't": "will",
    "isn't": "is",
    "不": "",
    "没": "有",
    "别": "",
}
PRONOUN_SWAPS = {
    "he ": "she ",
    "she ": "he ",
    "you ": "we ",
    "I ": "you ",
    "my ": "your ",
    "我": "你",
    "你": "我",
    "他": "她",
    "她": "他",
}
DIGIT_SWAPS = {str(d): str((d + 1) % 10) for d in range(10)} | {
    "一": "二",
    "二": "三",
    "三": "四",
    "两": "三",
}


def read_dialogues(path):
    """Utterance texts per Dialogue_ID, in file order (MELD: CRLF, quoted fields; CPED: a BOM)."""
    dialogues = defaultdict(list)
    with open(path, encoding="utf-8-sig", newline="") as f:
        for row in csv.DictReader(f):
            dialogues[row["Dialogue_ID"]].append(row["Utterance"])
    return list(dialogues.values())


NEGATION_WORD = re.compile(
    r"(?i)(no|not|never|nothing|nobody|none|neither|nor|cannot|without|\w+n[’']t)"
)
CLAUSE = re.compile(r"[^ ，。！？、,.!?~…]+")


def cut(rng, dialogue, spaced):
    """A quotation cut from one utterance or running across two consecutive ones, the way a careful
    reader quotes: English at word boundaries, never leaving out a negation just before the cut
    ("know" from "I don't know" is not a faithful quotation); Chinese as whole clauses."""
    i = rng.randrange(len(dialogue))
    text = dialogue[i] + (
        " " + dialogue[i + 1] if i + 1 < len(dialogue) and rng.random() < 0.3 else ""
    )
    if spaced:
        words = text.split(" ")
        length = rng.randint(1, min(len(words), 14))
        start = rng.randrange(len(words) - length + 1)
        if start > 0 and NEGATION_WORD.fullmatch(words[start - 1]):
            return ""
        return " ".join(words[start : start + length])
    clauses = list(CLAUSE.finditer(text))
    if not clauses:
        return ""
    first = rng.randrange(len(clauses))
    last = min(len(clauses) - 1, first + rng.randrange(3))
    return text[clauses[first].start() : clauses[last].end()]


def perturb(quote, swaps):
    """Apply the first swap whose key occurs in the quotation (a whole-word change for English)."""
    padded = f" {quote} "
    for old, new in swaps.items():
        for variant in (old, old.capitalize()):
            key = f" {variant}" if variant[0].isascii() and variant[0].isalpha() else variant
            if key in padded:
                replacement = (
                    f" {new.capitalize() if variant != old else new}"
                    if key.startswith(" ")
                    else new
                )
                return padded.replace(key, replacement, 1).strip()
    return None


def squash(text):
    return "".join(c for c in text.casefold() if c.isalnum())


def real_data_cases(dialogues, spaced, n=300):
    rng = random.Random(0)
    quotes, perturbed = [], []
    while len(quotes) < n:
        dialogue = rng.choice(dialogues)
        quote = cut(rng, dialogue, spaced)
        if not squash(quote):
            continue
        quotes.append((quote, dialogue))
        for swaps in (NEGATION_SWAPS, PRONOUN_SWAPS, DIGIT_SWAPS):
            changed = perturb(quote, swaps)
            # a perturbed copy that still occurs in the conversation is a real quotation after all
            if changed and squash(changed) and squash(changed) not in squash(" ".join(dialogue)):
                perturbed.append((changed, dialogue))
    return quotes, perturbed


@pytest.mark.parametrize("name", ["meld/dev_sent_emo.csv", "meld/train_sent_emo.csv"])
def test_meld_quotes_verify_and_perturbed_copies_do_not(shared_data, name):
    quotes, perturbed = real_data_cases(read_dialogues(shared_data / name), spaced=True)
    assert [q for q, d in quotes if not verify_quote(q, d)] == []
    assert len(perturbed) >= 50
    assert [q for q, d in perturbed if verify_quote(q, d)] == []


def test_meld_apostrophes_match_any_form(shared_data):
    dialogues = read_dialogues(shared_data / "meld/dev_sent_emo.csv")
    curly = [(u, d) for d in dialogues for u in d if "\u2019" in u][:50]
    assert len(curly) == 50
    for utterance, dialogue in curly:
        assert verify_quote(utterance.replace("\u2019", "'"), dialogue)
        assert verify_quote(utterance.replace("\u2019", ""), dialogue)


def test_cped_quotes_verify_and_perturbed_copies_do_not(shared_data):
    quotes, perturbed = real_data_cases(
        read_dialogues(shared_data / "cped/valid_split.csv"), spaced=False
    )
    assert [q for q, d in quotes if not verify_quote(q, d)] == []
    assert len(perturbed) >= 50
    assert [q for q, d in perturbed if verify_quote(q, d)] == []


def test_cped_quote_from_another_dialogue_does_not_verify(shared_data):
    dialogues = read_dialogues(shared_data / "cped/valid_split.csv")
    rng = random.Random(1)
    checked = 0
    for _ in range(200):
        a, b = rng.sample(dialogues, 2)
        quote = max(b, key=len)
        if len(squash(quote)) >= 8 and squash(quote) not in squash("".join(a)):
            assert not verify_quote(quote, a), quote
            checked += 1
    assert checked >= 100
