"""The quotation verifier V(e, C), evidence-tag parsing and the evidence-format term f.
Standard library only; imports nothing from the project.

V(e, C) answers one question: was the quotation e copied from the utterances of the conversation C?
Both sides are normalized (Unicode NFKC, case, width, digits of every script, apostrophe, quote,
dash and ellipsis forms, invisible characters, whitespace, punctuation) and cut into tokens: words
in alphabetic scripts, single characters in Chinese and Japanese, numbers with their inner `.,:`.
A quotation verifies when its tokens align with a contiguous run of conversation tokens
(consecutive utterances included) at a small typographical cost:

- each quotation token stands for one conversation token: the same, or a near-miss typo of a
  word of MIN_TYPO_LENGTH or more letters (same first letter, 1 edit, 2 from 8 letters up), which
  costs its optimal-string-alignment distance; shorter words and single Chinese or Japanese
  characters are never edited (one letter turns "love" into "lose", 好 into 坏);
- a typo is a misspelling, never another word: an edit may turn a word into a non-word or back
  ("tonihgt" for "tonight", "received" for a source's "recieved"), but never one English word
  of english_words.txt into another ("lonely" for "lovely", "trail" for "trial", "diner" for
  "dinner", "women" for "woman"), since swapping a word changes the evidence;
- a Chinese or Japanese character left out of the quotation costs 1; words are never dropped or
  added (an omission is marked with an ellipsis), so no word can be swapped for another;
- the total cost may not exceed min(MAX_EDIT_FRACTION * (characters in the quote), MAX_EDITS);
- protected tokens (PROTECTED: negations, pronouns, conjunctions, particles and numerals in
  English, Chinese and Japanese, and every token with a digit) are never edited or left out;
- the quotation's edges may not cut a protected Chinese or Japanese word, begin right after a
  negation written tight against it ("know" from "I don't know", 想去 from 不想去) or end right
  before a Japanese negation suffix (行け from 行けません): each would drop a negation by cutting.

A quotation whose exact text is not found is then read as ellipsis-separated fragments: each must
verify on its own, in source order, without overlapping the previous one, and carry at least
MIN_FRAGMENT_TOKENS tokens, so that a "quotation" cannot be stitched together from isolated words.
Speaker names, time markers and prompt text are not evidence: callers pass the utterance texts
only, and a quotation that needs any of them does not verify.

The work per quotation is bounded, so a hostile completion cannot stall or exhaust a trainer: a
quotation of more than MAX_QUOTE_TOKENS tokens (or 16 characters per such token), or of more than
MAX_FRAGMENTS fragments, does not verify (evidence is a span, not a transcript); and the
typo-tolerant search for the whole quotation, then the one for its fragments, each spend at most
MAX_SEARCH_WORK steps (token hits sorted, alignment cells filled, columns started). Only quotations
of very common words in long or repetitive conversations get there (genuine ones with a typo in a
10,000-turn conversation spend under 100,000); past it only exact copies, found by a linear scan,
still match.
"""

from __future__ import annotations

import bisect
import functools
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

MAX_EDIT_FRACTION = 0.1  # one typographical edit per 10 characters of the quotation ...
MAX_EDITS = 6  # ... and never more than this many, however long the quotation
MIN_FRAGMENT_TOKENS = 2
MAX_QUOTE_TOKENS = 100  # the bounds on work of the module docstring
MAX_FRAGMENTS = 8
MAX_SEARCH_WORK = 250_000
MIN_TYPO_LENGTH = 5  # shorter words and single CJK characters are never edited
# Common English words with their inflections (SCOWL size 35; source, derivation and licence in the
# file's header): a typo edit never turns one of them into another.
ENGLISH_WORDS_FILE = Path(__file__).parent / "assets" / "english_words.txt"

EVIDENCE_OPEN, EVIDENCE_CLOSE = "<evidence>", "</evidence>"  # the evidence tags, defined here only

# Words whose change flips the meaning of a quotation. English entries are written after
# normalization (apostrophes removed: "don't" -> "dont", "I'm" -> "im"); Chinese and Japanese
# entries may be single characters or words. Extend a language by adding strings to its sets.
PROTECTED: dict[str, dict[str, set[str]]] = {
    "negation": {
        "en": set(
            "not no never nothing nobody none noone nowhere neither nor cannot without hardly "
            "barely nope nah dont doesnt didnt isnt arent wasnt werent wont wouldnt cant couldnt "
            "shouldnt hasnt havent hadnt aint mustnt neednt shant mightnt".split()
        ),
        "zh": set("不 没 沒 别 別 未 无 無 非 勿 莫 否 甭".split()),
        "ja": set("無い いいえ だめ ダメ 不 無 非 未".split()),
    },
    "negation_suffix": {  # negations written after the word they negate
        "ja": set("ない ません なかった ず ぬ じゃない ではない".split()),
    },
    "pronoun": {
        "en": set(
            (
                "i me my mine myself you your yours yourself yourselves he him his himself she "
                "her hers herself it its itself we us our ours ourselves they them their theirs "
                "themselves this that these those who whom whose someone somebody everyone "
                "everybody anyone anybody im ive id ill youre youve youd youll hes hed shes shed "
                "were weve wed well theyre theyve theyd theyll lets"
            ).split()
        ),
        "zh": set(
            (
                "我 你 妳 您 他 她 它 牠 祂 们 們 咱 俺 这 這 那 哪 谁 誰 啥 其 此 自己 人家 大家"
            ).split()
        ),
        "ja": set(
            "私 僕 俺 我 君 彼 貴方 あなた あんた わたし わたくし ぼく おれ きみ 彼女 彼ら 自分 "
            "これ それ あれ この その あの ここ そこ あそこ 誰 だれ".split()
        ),
    },
    "conjunction": {
        "en": set(
            "and but or so yet because cause although though if unless while whereas since until "
            "till either whether than".split()
        ),
        "zh": set(
            (
                "和 与 與 跟 及 而 但 却 卻 或 且 并 並 因为 因為 所以 虽然 雖然 但是 可是 不过 "
                "不過 如果 要是 而且 或者 还是 還是 然后 然後 于是 於是 既然 即使 尽管 儘管 只要 "
                "除非 无论 無論"
            ).split()
        ),
        "ja": set(
            (
                "そして しかし でも だから それで また および または けれども けど ところが "
                "なのに ただし つまり"
            ).split()
        ),
    },
    "particle": {
        "zh": set(
            "了 吗 嗎 呢 吧 啊 呀 的 地 得 着 著 过 過 嘛 啦 哦 喔 么 麼 呗 唄 哇 嘞 咯".split()
        ),
        "ja": set(
            (
                "は が を に で と も の へ や か ね よ な わ から まで より だけ しか ばかり "
                "ほど など って のに ので"
            ).split()
        ),
    },
    "numeral": {
        "en": set(
            (
                "zero one two three four five six seven eight nine ten eleven twelve thirteen "
                "fourteen fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty "
                "sixty seventy eighty ninety hundred thousand million billion dozen half once "
                "twice first second third fourth fifth sixth seventh eighth ninth tenth"
            ).split()
        ),
        "zh": set(
            (
                "〇 零 一 二 三 四 五 六 七 八 九 十 百 千 万 萬 亿 億 两 兩 壹 贰 貳 叁 參 肆 伍 "
                "陆 陸 柒 捌 玖 拾 佰 仟 半 几 幾"
            ).split()
        ),
        "ja": set("〇 一 二 三 四 五 六 七 八 九 十 百 千 万 億 兆 半 幾".split()),
    },
}

_CJK = (
    "\u3005\u3007\u3041-\u3096\u309d-\u309f\u30a1-\u30fa\u30fc-\u30ff"  # kana and marks
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
)  # CJK ideographs
_TOKEN = re.compile(rf"\d+(?:[.,:]\d+)+|[{_CJK}]|(?:(?![{_CJK}])[^\W_])+")
_IS_CJK = re.compile(rf"[{_CJK}]")
_APOSTROPHES = re.compile("[\u2018\u2019\u201a\u201b\u2032\u02bc\u02b9`\u00b4\u0091\u0092]")
_INNER_APOSTROPHE = re.compile(r"(?<=[^\W_])'(?=[^\W_])")
_ELLIPSIS = re.compile(r"\.(?:\s*\.)+|[\u2026\u22ef\u2025]+|。{2,}|・{2,}|·{2,}|･{2,}")
_MOJIBAKE = {
    "\u00e2\u20ac\u2122": "'",
    "\u00e2\u20ac\u02dc": "'",
    "\u00e2\u20ac\u0153": '"',
    "\u00e2\u20ac\u009d": '"',
    "\u00e2\u20ac\u00a6": "\u2026",
    "\u00e2\u20ac\u201d": "-",
}


def _protected_sets(categories) -> tuple[frozenset[str], frozenset[str], re.Pattern | None]:
    """Split the PROTECTED entries of some categories into alphabetic words, single CJK characters
    and a pattern finding (overlapping) multi-character CJK words."""
    words, chars, cjk_words = set(), set(), set()
    for category in categories:
        for entries in PROTECTED[category].values():
            for entry in map(normalize, entries):
                if not _IS_CJK.search(entry):
                    words.add(entry)
                elif len(entry) == 1:
                    chars.add(entry)
                else:
                    cjk_words.add(entry)
    pattern = "|".join(sorted(map(re.escape, cjk_words), key=len, reverse=True))
    return frozenset(words), frozenset(chars), re.compile(f"(?=({pattern}))") if pattern else None


def normalize(text: str) -> str:
    """Canonical text: one form per apostrophe, quote, dash and ellipsis, NFKC (width), case folded,
    every decimal digit as ASCII, invisible format characters removed, whitespace collapsed."""
    for broken, fixed in _MOJIBAKE.items():
        text = text.replace(broken, fixed)
    text = _APOSTROPHES.sub("'", text)
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(
        str(unicodedata.digit(c)) if unicodedata.category(c) == "Nd" else c
        for c in text
        if unicodedata.category(c) != "Cf"
    )
    text = _ELLIPSIS.sub("\u2026", text)
    return " ".join(text.split())


_PROTECTED = _protected_sets(PROTECTED)
_NEGATIONS = _protected_sets(["negation"])
_NEGATION_SUFFIXES = _protected_sets(["negation_suffix"])


def _marks(text: str, protected) -> tuple[list[bool], list[int]]:
    """Per character of `text`: whether it is a protected word or character, and the id of the
    multi-character CJK protected word it belongs to (-1 for none)."""
    words, chars, cjk_words = protected
    marked, word_id = [False] * len(text), [-1] * len(text)
    for m in _TOKEN.finditer(text):
        if m.group() in words or m.group() in chars:
            marked[m.start()] = True
    if cjk_words is not None:
        for m in cjk_words.finditer(text):
            # overlapping words are one
            word = word_id[m.start(1)] if word_id[m.start(1)] >= 0 else m.start(1)
            for i in range(m.start(1), m.end(1)):
                marked[i], word_id[i] = True, word
    return marked, word_id


@dataclass(frozen=True)
class _Tokens:
    """A text as tokens. rigid: protected (never edited, dropped or added). A quotation may not
    begin at token j when no_start[j], nor end just before it when no_end[j]: the cut would split a
    protected CJK word, or leave out a negation written tight against (no punctuation between) the
    words it negates. turn_of: the utterance each token came from (conversations only)."""

    tokens: tuple[str, ...]
    rigid: tuple[bool, ...]
    no_start: tuple[bool, ...]
    no_end: tuple[bool, ...]
    turn_of: tuple[int, ...] = ()


def _tokenize(normalized: str) -> _Tokens:
    text = _INNER_APOSTROPHE.sub("", normalized)
    protected, word_id = _marks(text, _PROTECTED)
    negation, _ = _marks(text, _NEGATIONS)
    negation_suffix, _ = _marks(text, _NEGATION_SUFFIXES)
    tokens, rigid, no_start, no_end, previous = [], [], [], [], None
    for m in _TOKEN.finditer(text):
        token, at = m.group(), m.start()
        tokens.append(token)
        rigid.append(protected[at] or any(c.isdigit() for c in token))
        if previous is None:
            no_start.append(False)
            no_end.append(False)
        else:
            tight = not text[previous.end() : at].strip()
            same_word = word_id[at] >= 0 and word_id[at] == word_id[previous.start()]
            no_start.append(same_word or (tight and negation[previous.start()]))
            no_end.append(same_word or (tight and negation_suffix[at]))
        previous = m
    return _Tokens(tuple(tokens), tuple(rigid), tuple(no_start), tuple(no_end))


def word_tokens(text: str) -> list[str]:
    """The normalized tokens of a text: words in alphabetic scripts, single Chinese or Japanese
    characters, numbers (punctuation and whitespace dropped)."""
    return list(_tokenize(normalize(text)).tokens)


@dataclass(frozen=True)
class _Conversation:
    text: _Tokens
    joined: str  # "\0tok\0tok\0...\0": exact token runs are found with str.find
    offsets: tuple[int, ...]  # where each token starts in `joined`
    positions: dict[str, list[int]]  # token -> its indices, ascending


@functools.lru_cache(maxsize=32)
def _conversation(utterances: tuple[str, ...]) -> _Conversation:
    tokens, rigid, no_start, no_end, turn_of = [], [], [], [], []
    for turn, utterance in enumerate(utterances):
        text = _tokenize(normalize(utterance))
        tokens += text.tokens
        rigid += text.rigid
        no_start += text.no_start
        no_end += text.no_end
        turn_of += [turn] * len(text.tokens)
    offsets, position, positions = [], 1, {}
    for index, token in enumerate(tokens):
        offsets.append(position)
        position += len(token) + 1
        positions.setdefault(token, []).append(index)
    joined = "\0" + "\0".join(tokens) + "\0"
    text = _Tokens(
        tuple(tokens),
        tuple(rigid),
        tuple(no_start) + (False,),
        tuple(no_end) + (False,),
        tuple(turn_of),
    )
    return _Conversation(text, joined, tuple(offsets), positions)


@functools.cache
def english_words() -> frozenset[str]:
    """The words of ENGLISH_WORDS_FILE (lines starting with # are its header)."""
    with open(ENGLISH_WORDS_FILE, encoding="utf-8") as f:
        return frozenset(word for line in f if (word := line.strip()) and not word.startswith("#"))


@functools.lru_cache(maxsize=65536)
def _word_edit_cost(a: str, b: str) -> int | None:
    """Optimal-string-alignment distance between two different words when it is a near-miss typo,
    else None: the longer word has at least MIN_TYPO_LENGTH characters, both keep the first letter,
    they differ by at most 1 edit (2 from 8 characters up), and they are not both English words."""
    longest = max(len(a), len(b))
    cap = 2 if longest >= 8 else 1
    if longest < MIN_TYPO_LENGTH or abs(len(a) - len(b)) > cap or a[0] != b[0]:
        return None
    if a in english_words() and b in english_words():
        return None
    previous2, previous = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], previous2[j - 2] + 1)
        previous2, previous = previous, row
    return previous[-1] if previous[-1] <= cap else None


def _edit_budget(quote_tokens: tuple[str, ...]) -> int:
    """The largest total alignment cost a quotation with these tokens may have."""
    return min(int(MAX_EDIT_FRACTION * sum(map(len, quote_tokens))), MAX_EDITS)


class _OutOfWork(Exception):
    pass


class _Work:
    """The search work one quotation may still spend (MAX_SEARCH_WORK in all)."""

    def __init__(self):
        self.left = MAX_SEARCH_WORK

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < 0:
            raise _OutOfWork


def _candidate_windows(
    q: _Tokens, conv: _Conversation, start: int, budget: int, work: _Work
) -> list[tuple[int, int]]:
    """Conversation token ranges that can hold an alignment of cost <= budget beginning at or after
    `start`. Every edit costs at least 1, so such an alignment leaves at least len(q) - budget quote
    tokens matched exactly, all on diagonals (conversation index - quote index) within `budget` of
    where it begins: count those diagonals and keep the ranges around dense clusters."""
    n, m = len(conv.text.tokens), len(q.tokens)
    need = m - budget
    if need <= 0:
        return [(start, n)] if start < n else []
    found = [conv.positions.get(token, []) for token in q.tokens]
    first = [bisect.bisect_left(positions, start) for positions in found]
    work.spend(sum(len(positions) - k for positions, k in zip(found, first)))
    diagonals = sorted(
        p - i for i, (positions, k) in enumerate(zip(found, first)) for p in positions[k:]
    )
    windows: list[tuple[int, int]] = []
    right = 0
    for left, d in enumerate(diagonals):
        while right < len(diagonals) and diagonals[right] <= d + 2 * budget:
            right += 1
        if right - left >= need:
            lo, hi = max(start, d - budget), min(n, d + m + 2 * budget)
            if windows and lo <= windows[-1][1]:
                windows[-1] = (windows[-1][0], max(windows[-1][1], hi))
            elif lo < hi:
                windows.append((lo, hi))
    return windows


def _align(q: _Tokens, conv: _Tokens, lo: int, hi: int, budget: int) -> tuple[int, int] | None:
    """Earliest-ending run conv[a:b] (lo <= a < b <= hi) that the quote aligns to at cost <= budget.
    Column-wise semi-global DP: cost[i] = cheapest alignment of q[:i] ending at the current column;
    a quote token aligns to one conversation token (equal, or a near-miss typo), and a conversation
    character the quote left out may be skipped. The run respects no_start and no_end."""
    m, over = len(q.tokens), budget + 1
    cost, begin = [over if conv.no_start[lo] else 0] + [over] * m, [lo] * (m + 1)
    for j in range(lo, hi):
        s, s_rigid = conv.tokens[j], conv.rigid[j]
        skip = over if s_rigid or not _IS_CJK.fullmatch(s) else 1
        new_cost, new_begin = [over if conv.no_start[j + 1] else 0] + [over] * m, [j + 1] * (m + 1)
        for i in range(1, m + 1):
            t = q.tokens[i - 1]
            if t == s:
                edit = 0
            elif q.rigid[i - 1] or s_rigid:
                edit = over
            else:
                edit = _word_edit_cost(t, s)
                edit = over if edit is None else edit
            best, first = cost[i - 1] + edit, begin[i - 1]
            if cost[i] + skip < best:
                best, first = cost[i] + skip, begin[i]
            new_cost[i], new_begin[i] = min(best, over), first
        cost, begin = new_cost, new_begin
        if cost[m] <= budget and not conv.no_end[j + 1]:
            return begin[m], j + 1
    return None


def _find(q: _Tokens, conv: _Conversation, start: int, work: _Work) -> tuple[int, int] | None:
    """The earliest-ending match of the quote tokens in the conversation at or after token `start`.
    Windows are aligned in pieces that overlap by the longest a match can be (every quote token plus
    `budget` skipped characters), so each match lies whole in a piece and work is spent as it
    goes."""
    budget = _edit_budget(q.tokens)
    reach = len(q.tokens) + budget
    for lo, hi in _candidate_windows(q, conv, start, budget, work):
        for piece in range(lo, hi, 4 * reach):
            end = min(hi, piece + 5 * reach)
            work.spend((end - piece) * (len(q.tokens) + 4))  # cells, and each column's own upkeep
            span = _align(q, conv.text, piece, end, budget)
            if span is not None:
                return span
    return None


def _find_exact(q: _Tokens, conv: _Conversation, start: int = 0) -> tuple[int, int] | None:
    """The first exact occurrence of the quote tokens at or after token `start` that may begin and
    end where it does: a linear scan, however common the tokens are."""
    if start >= len(conv.offsets):
        return None
    needle, at = "\0" + "\0".join(q.tokens) + "\0", conv.offsets[start] - 1
    while (at := conv.joined.find(needle, at)) >= 0:
        first = bisect.bisect_left(conv.offsets, at + 1)
        last = first + len(q.tokens)
        if not conv.text.no_start[first] and not conv.text.no_end[last]:
            return first, last
        at += 1
    return None


def _locate(q: _Tokens, conv: _Conversation, start: int, work: _Work) -> tuple[int, int] | None:
    """`_find` while `work` lasts; once it is spent, only an exact copy is found."""
    try:
        return _find(q, conv, start, work)
    except _OutOfWork:
        return _find_exact(q, conv, start)


def _match(
    quote: str, conversation: list[str] | tuple[str, ...] | str, exact: bool = False
) -> list[tuple[int, int]] | None:
    """Token spans in the conversation that the quotation (or each of its fragments) matched, or
    None."""
    if len(quote) > 16 * MAX_QUOTE_TOKENS:
        return None
    text = normalize(quote)
    whole = _tokenize(text)
    if not 0 < len(whole.tokens) <= MAX_QUOTE_TOKENS:
        return None
    conv = _conversation((conversation,) if isinstance(conversation, str) else tuple(conversation))
    span = _find_exact(whole, conv) or (None if exact else _locate(whole, conv, 0, _Work()))
    if span is not None:
        return [span]
    if exact:
        return None
    fragments = [f for f in map(_tokenize, text.split("\u2026")) if f.tokens]
    if not 2 <= len(fragments) <= MAX_FRAGMENTS or any(
        len(f.tokens) < MIN_FRAGMENT_TOKENS for f in fragments
    ):
        return None
    spans, start, work = [], 0, _Work()
    for fragment in fragments:
        span = _locate(fragment, conv, start, work)
        if span is None:
            return None
        spans.append(span)
        start = span[1]
    return spans


def verify_quote(quote: str, conversation: list[str] | str, exact: bool = False) -> bool:
    """V(e, C): True when the quotation was copied from the conversation's utterance texts (a list,
    one string per utterance, or one string), up to the bounded variation of the module docstring.
    exact=True allows normalization only: the quotation's tokens must occur as one contiguous run
    (no typographical edits, no left-out characters, no ellipsis fragments)."""
    return _match(quote, conversation, exact) is not None


def locate_quote(quote: str, conversation: list[str] | str) -> list[int]:
    """Indices of the utterances a verified quotation matched (ascending); [] when it does not
    verify."""
    spans = _match(quote, conversation)
    if spans is None:
        return []
    turn_of = _conversation(
        (conversation,) if isinstance(conversation, str) else tuple(conversation)
    ).text.turn_of
    return sorted({turn_of[i] for a, b in spans for i in range(a, b)})


# ----------------------------------------------------------------------------- evidence tags

_TAG = re.compile(f"{re.escape(EVIDENCE_OPEN)}|{re.escape(EVIDENCE_CLOSE)}")
_QUOTATION = re.compile(
    f"{re.escape(EVIDENCE_OPEN)}.*?(?={_TAG.pattern}|\\Z)|{re.escape(EVIDENCE_CLOSE)}", re.DOTALL
)


def extract_quotes(text: str) -> list[str]:
    """The text after each <evidence> opener, up to the next evidence tag or the end of the text.
    An unclosed quotation is still a quotation: it has to verify like the others, so a broken tag
    cannot hide an invented quote from the verifier."""
    tags = list(_TAG.finditer(text)) + [None]
    return [
        text[tag.end() : (after.start() if after else len(text))].strip()
        for tag, after in zip(tags, tags[1:])
        if tag.group() == EVIDENCE_OPEN
    ]


def without_quotes(text: str) -> str:
    """The writer's own words: the text with its evidence tags and every quotation that
    extract_quotes reads replaced by a space."""
    return _QUOTATION.sub(" ", text)


def format_score(text: str) -> float:
    """f = n_closed / (n_open + n_stray). An opener is closed when the next evidence tag after it is
    a closer; a stray closer is one that closes nothing. f = 1 when the text has no evidence
    tags."""
    tags = [m.group() for m in _TAG.finditer(text)]
    if not tags:
        return 1.0
    n_open = tags.count(EVIDENCE_OPEN)
    n_closed = sum(a == EVIDENCE_OPEN and b == EVIDENCE_CLOSE for a, b in zip(tags, tags[1:]))
    n_stray = tags.count(EVIDENCE_CLOSE) - n_closed
    return n_closed / (n_open + n_stray)


def quotes_by_block(
    blocks: list[str], conversation: list[str] | str
) -> list[list[tuple[str, bool]]]:
    """For each reasoning block, its quotations with V(e, C) for each."""
    return [
        [(quote, verify_quote(quote, conversation)) for quote in extract_quotes(block)]
        for block in blocks
    ]
